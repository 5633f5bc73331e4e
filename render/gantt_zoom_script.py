"""The plan page's only script: zoom and pan for the inline Gantt chart, fitted to the window's width.

It is a constant: no plan data is ever written into it (it reads the chart's geometry from the SVG's
data attributes and writes text only through `textContent`), so nothing a user sends can reach a
script context, and a Content-Security-Policy can allow exactly this script by its hash
(`SCRIPT_CSP_SOURCE`). Without script the page shows the same chart, unzoomed and scaled to fit.

Controls: the buttons above the chart; Ctrl/Cmd + wheel or double-click (Shift: out) zooms at the
pointer; dragging or Shift + wheel pans; with the chart focused, + - arrows and 0 (whole iteration).
Ops that become wide enough get their label, and every op a hover title, at any zoom.
"""

from __future__ import annotations

import base64
import hashlib

GANTT_ZOOM_JS = r"""
(function () {
  "use strict";
  var SVG_NS = "http://www.w3.org/2000/svg";
  var OP_CHAR_PX = 5.5, MAX_ZOOM = 4096, MIN_PLOT_PX = 160, TICK_SPACING_PX = 64;
  var cards = document.querySelectorAll("[data-gantt-zoom]");
  for (var c = 0; c < cards.length; c++) setUp(cards[c]);

  function niceStep(span, targetTicks) {
    if (!(span > 0)) return 1;
    var raw = span / targetTicks, power = Math.pow(10, Math.floor(Math.log10(raw)));
    var multiples = [1, 2, 5, 10];
    for (var i = 0; i < multiples.length; i++) if (multiples[i] * power >= raw) return multiples[i] * power;
    return 10 * power;
  }

  function formatMs(value, digits) {
    return value.toLocaleString("en-US", {minimumFractionDigits: 0, maximumFractionDigits: digits});
  }

  function digitsFor(resolutionMs) {
    return Math.max(0, Math.min(3, Math.ceil(-Math.log10(resolutionMs))));
  }

  function clamp(value, low, high) { return Math.min(Math.max(value, low), high); }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function setUp(card) {
    var svg = card.querySelector("svg.gantt");
    var tools = card.querySelector("[data-gantt-tools]");
    if (!svg || !tools) return;
    var left = Number(svg.dataset.plotLeftPx), basePlot = Number(svg.dataset.plotWidthPx);
    var margin = Number(svg.dataset.marginPx), makespan = Number(svg.dataset.makespanMs);
    var axis = svg.querySelector("g.axis"), clip = svg.querySelector("clipPath rect");
    if (!(makespan > 0 && basePlot > 0 && isFinite(makespan)) || !axis || !clip) return;
    var height = svg.viewBox.baseVal.height, basePxPerMs = basePlot / makespan;
    var axisTop = Number(axis.dataset.topPx), axisBottom = Number(axis.dataset.bottomPx);
    var readout = tools.querySelector("[data-gantt-readout]");
    var rows = Array.prototype.map.call(svg.querySelectorAll("g.row"), function (row) {
      var ops = row.querySelector("g.ops"), rects = ops.querySelectorAll("rect");
      var x = new Float64Array(rects.length), w = new Float64Array(rects.length);
      for (var i = 0; i < rects.length; i++) {
        x[i] = Number(rects[i].getAttribute("x"));
        w[i] = Number(rects[i].getAttribute("width"));
      }
      var barHeight = rects.length ? Number(rects[0].getAttribute("height")) : 0;
      return {ops: ops, base: ops.getAttribute("transform") || "", labels: row.querySelector("g.op-labels"),
              idle: row.querySelector("rect.idle"), rects: rects, x: x, w: w, baseline: barHeight / 2 + 3};
    });
    var view = {start: 0, span: makespan}, plot = basePlot, pending = false;

    function pxPerMs() { return plot / view.span; }

    function fit() {
      var style = getComputedStyle(card);
      var inner = card.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      plot = Math.max(MIN_PLOT_PX, Math.floor(inner - left - margin));
      var width = left + plot + margin;
      svg.setAttribute("width", String(width));
      svg.setAttribute("viewBox", "0 0 " + width + " " + height);
      clip.setAttribute("width", String(plot));
      draw();
    }

    function relabel(row, scale, shift) {
      clear(row.labels);
      var low = left, high = left + plot;
      for (var i = 0; i < row.x.length; i++) {
        var x0 = scale * row.x[i] + shift, x1 = x0 + scale * row.w[i];
        if (x1 <= low || x0 >= high) continue;
        var a = Math.max(x0, low), b = Math.min(x1, high);
        var name = row.rects[i].getAttribute("data-op") || "";
        if (b - a < name.length * OP_CHAR_PX + 4) continue;
        var text = document.createElementNS(SVG_NS, "text");
        text.setAttribute("class", name.charAt(0) === "I" || name.charAt(0) === "W" ? "op dark" : "op");
        text.setAttribute("x", ((a + b) / 2).toFixed(2));
        text.setAttribute("y", String(row.baseline));
        text.textContent = name;
        row.labels.appendChild(text);
      }
    }

    function drawAxis() {
      clear(axis);
      var step = niceStep(view.span, Math.max(2, Math.floor(plot / TICK_SPACING_PX)));
      var digits = digitsFor(step), first = Math.ceil(view.start / step - 1e-9), end = view.start + view.span;
      for (var i = first; i * step <= end + step * 1e-9; i++) {
        var time = i * step || 0, x = (left + (time - view.start) * pxPerMs()).toFixed(2);
        var line = document.createElementNS(SVG_NS, "line");
        line.setAttribute("x1", x); line.setAttribute("x2", x);
        line.setAttribute("y1", String(axisTop - 4)); line.setAttribute("y2", String(axisBottom));
        line.setAttribute("stroke", "#d0d0d0"); line.setAttribute("stroke-width", "0.5");
        var label = document.createElementNS(SVG_NS, "text");
        label.setAttribute("class", "tick"); label.setAttribute("x", x); label.setAttribute("y", String(axisTop - 8));
        label.textContent = formatMs(time, digits);
        axis.appendChild(line); axis.appendChild(label);
      }
    }

    function draw() {
      pending = false;
      var scale = pxPerMs() / basePxPerMs, shift = left - scale * left - view.start * pxPerMs();
      var transform = " translate(" + shift.toFixed(3) + ",0) scale(" + scale.toPrecision(8) + ",1)";
      rows.forEach(function (row) {
        row.ops.setAttribute("transform", row.base + transform);
        row.idle.setAttribute("width", String(plot));
        relabel(row, scale, shift);
      });
      drawAxis();
      var end = view.start + view.span, digits = digitsFor(view.span / plot);
      card.dataset.viewStartMs = String(view.start);
      card.dataset.viewEndMs = String(end);
      readout.textContent = "showing " + formatMs(view.start, digits) + "–" + formatMs(end, digits) + " ms of " +
        formatMs(makespan, 3) + " ms (" + formatMs(makespan / view.span, 1) + "×)";
    }

    function schedule() {
      if (!pending) { pending = true; window.requestAnimationFrame(draw); }
    }

    function setView(start, span) {
      view.span = clamp(span, makespan / MAX_ZOOM, makespan);
      view.start = clamp(start, 0, makespan - view.span);
      schedule();
    }

    function zoomAt(factor, anchorMs) {
      var span = clamp(view.span / factor, makespan / MAX_ZOOM, makespan);
      setView(anchorMs - (anchorMs - view.start) * span / view.span, span);
    }

    function timeAt(event) {
      var matrix = svg.getScreenCTM();
      if (!matrix) return view.start + view.span / 2;
      var point = new DOMPoint(event.clientX, event.clientY).matrixTransform(matrix.inverse());
      return clamp(view.start + (point.x - left) / pxPerMs(), 0, makespan);
    }

    function userPxPerScreenPx() {
      var matrix = svg.getScreenCTM();
      return matrix && matrix.a ? 1 / matrix.a : 1;
    }

    var actions = {
      "in": function () { zoomAt(2, view.start + view.span / 2); },
      "out": function () { zoomAt(0.5, view.start + view.span / 2); },
      "left": function () { setView(view.start - view.span / 4, view.span); },
      "right": function () { setView(view.start + view.span / 4, view.span); },
      "reset": function () { setView(0, makespan); }
    };
    tools.addEventListener("click", function (event) {
      var button = event.target.closest("[data-gantt-action]");
      if (button && actions[button.dataset.ganttAction]) actions[button.dataset.ganttAction]();
    });
    svg.addEventListener("wheel", function (event) {
      if (event.ctrlKey || event.metaKey) {
        event.preventDefault();
        zoomAt(Math.exp(-event.deltaY * 0.002), timeAt(event));
      } else if (event.shiftKey || Math.abs(event.deltaX) > Math.abs(event.deltaY)) {
        event.preventDefault();
        var delta = Math.abs(event.deltaX) > Math.abs(event.deltaY) ? event.deltaX : event.deltaY;
        setView(view.start + delta * userPxPerScreenPx() / pxPerMs(), view.span);
      }
    }, {passive: false});
    svg.addEventListener("dblclick", function (event) {
      event.preventDefault();
      zoomAt(event.shiftKey ? 0.5 : 2, timeAt(event));
    });
    var drag = null;
    svg.addEventListener("pointerdown", function (event) {
      if (event.button !== 0 || view.span >= makespan) return;
      drag = {x: event.clientX, start: view.start, id: event.pointerId};
      svg.setPointerCapture(event.pointerId);
      svg.classList.add("dragging");
    });
    svg.addEventListener("pointermove", function (event) {
      if (!drag || event.pointerId !== drag.id) return;
      var movedMs = (event.clientX - drag.x) * userPxPerScreenPx() / pxPerMs();
      setView(drag.start - movedMs, view.span);
    });
    function endDrag() { drag = null; svg.classList.remove("dragging"); }
    svg.addEventListener("pointerup", endDrag);
    svg.addEventListener("pointercancel", endDrag);
    card.addEventListener("keydown", function (event) {
      var key = {"+": "in", "=": "in", "-": "out", "ArrowLeft": "left", "ArrowRight": "right", "0": "reset"}[event.key];
      if (key && event.target === card) { event.preventDefault(); actions[key](); }
    });
    svg.addEventListener("pointerover", function (event) {
      var rect = event.target;
      if (!rect.matches || !rect.matches("g.ops > rect") || rect.querySelector("title")) return;
      var start = (Number(rect.getAttribute("x")) - left) / basePxPerMs;
      var end = start + Number(rect.getAttribute("width")) / basePxPerMs;
      var digits = digitsFor(0.005 / basePxPerMs);
      var title = document.createElementNS(SVG_NS, "title");
      title.textContent = (rect.getAttribute("data-op") || "") + " ≈" + formatMs(start, digits) + "–" +
        formatMs(end, digits) + " ms";
      rect.appendChild(title);
    });
    var resizing = false;
    window.addEventListener("resize", function () {
      if (!resizing) {
        resizing = true;
        window.requestAnimationFrame(function () { resizing = false; fit(); });
      }
    });
    card.classList.add("zoomable");
    card.tabIndex = 0;
    tools.hidden = false;
    fit();
  }
})();
"""


def script_csp_source(script: str = GANTT_ZOOM_JS) -> str:
    """The CSP source expression (`'sha256-…'`) that allows exactly this inline script."""
    digest = hashlib.sha256(script.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


SCRIPT_CSP_SOURCE = script_csp_source()
