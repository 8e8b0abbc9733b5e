// The overview's live counts: server-sent events from /live while the tab is visible.
// Without JavaScript the page is the same, as of its loading.
(function () {
  "use strict";
  var table = document.getElementById("totals");
  if (!table || !window.EventSource) { return; }
  var source = null;
  function open() {
    if (source) { return; }
    source = new EventSource(table.getAttribute("data-live"));
    source.addEventListener("totals", function (event) {
      var counts = JSON.parse(event.data);
      Object.keys(counts).forEach(function (status) {
        var cell = table.querySelector('td[data-status="' + status + '"]');
        if (cell) { cell.textContent = String(counts[status]); }
      });
      table.setAttribute("data-updated", String(Date.now()));
    });
  }
  function close() {
    if (source) { source.close(); source = null; }
  }
  // a hidden tab costs the database nothing
  document.addEventListener("visibilitychange", function () {
    if (document.hidden) { close(); } else { open(); }
  });
  if (!document.hidden) { open(); }
}());
