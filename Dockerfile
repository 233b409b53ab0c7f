# The whole course on any OS: Linux, with the same `make install` as the README, and JupyterLab
# listening for the host's browser.
#
#   docker build -t flashedu .
#   docker run --rm -it -p 8888:8888 flashedu     # open the URL it prints (token included)
#
# The image is Debian 12 with Python 3.11; the install inside it downloads about 2.9 GB (the README,
# "Installing"). Notebooks you edit live in the container: mount the repository to keep them,
#   docker run --rm -it -p 8888:8888 -v "$PWD/notebooks:/course/notebooks" flashedu
# BASE: any Debian 12 image with Python 3.11, venv and apt (the test suite builds one with debootstrap).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
# Behind a proxy that re-signs TLS, pass its CA bundle to pip: --build-arg PIP_CERT=/path/in/image
# (mounted with -v at build time).
ARG PIP_CERT

RUN apt-get update \
    && apt-get install -y --no-install-recommends make git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /course
# The environment lives outside /course, so a repository mounted there (the devcontainer) keeps it.
ENV VENV=/opt/flashedu-venv
# What `make install` reads first, so a change to a notebook does not reinstall the environment.
COPY Makefile requirements.txt constraints.txt pyproject.toml README.md ./
COPY flashedu ./flashedu
RUN make install
COPY . .

EXPOSE 8888
# HOST: listen on every interface of the container; URL_HOST: the address the host's browser uses.
CMD ["make", "lab", "HOST=0.0.0.0", "URL_HOST=127.0.0.1", "PORT=8888"]
