// flashedu: loaded after RequireJS and before the ipywidgets embed manager. The manager's modules
// find their fonts relative to their own module URLs; without this, RequireJS puts those URLs
// beside the page (notebooks/@jupyter-widgets/...) and every font is a 404. This file sits in
// _static/, the manager's files (fonts included) in _static/widgets/.
(function () {
  var here = document.currentScript && document.currentScript.src;
  if (!here || typeof window.require === "undefined" || !window.require.config) {
    return;
  }
  var widgets = new URL("widgets", here).href;
  window.require.config({
    paths: {
      "@jupyter-widgets": widgets, // @jupyter-widgets/base, controls, output, html-manager
      "@jupyter-widgets/html-manager/dist": widgets, // .../dist/libembed-amd
    },
  });
})();
