"use strict";
// Small SVG charts drawn here, from numbers (no chart library): grouped bars and lines.

const fkCharts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 560, H = 240, LEFT = 64, RIGHT = 12, TOP = 28, BOTTOM = 44;
  const COLOURS = ["#3465a4", "#e08a1e", "#4e9a06", "#a33fa3", "#c4312b", "#2aa1b3"];

  function svg(tag, attrs, text) {
    const node = document.createElementNS(NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /** About five round ticks from lo to hi. */
  function ticks(lo, hi) {
    if (hi === lo) hi = lo + 1;
    const raw = (hi - lo) / 4;
    const step = [1, 2, 2.5, 5, 10].map((m) => m * 10 ** Math.floor(Math.log10(raw)))
      .find((s) => s >= raw);
    const out = [];
    for (let t = Math.floor(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
    if (out[out.length - 1] < hi) out.push(out[out.length - 1] + step);
    return out;
  }

  /** A number as a label: three significant digits, or as many more as tell it from a
   * neighbour `step` away (ticks 21000, 21100, ... all read 2.1e+4 with a fixed count). */
  function label(value, step) {
    if (value === 0) return "0";
    const abs = Math.abs(value);
    const apart = step ? Math.floor(Math.log10(abs)) - Math.floor(Math.log10(step)) + 1 : 0;
    const digits = Math.min(Math.max(3, apart), 12);
    if (abs >= 1e6 || abs < 1e-3) return value.toExponential(digits - 1).replace(/\.?0+e/, "e");
    return String(Number(value.toPrecision(digits)));
  }

  function frame(title, yLabel, lo, hi) {
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img",
                             "aria-label": title});
    root.append(svg("title", {}, title));
    root.append(svg("text", {x: LEFT, y: 16, class: "chart-title"}, title));
    const ys = ticks(lo, hi);
    const y0 = ys[0], y1 = ys[ys.length - 1], step = ys.length > 1 ? ys[1] - ys[0] : 0;
    const y = (v) => TOP + (H - TOP - BOTTOM) * (1 - (v - y0) / (y1 - y0));
    for (const t of ys) {
      root.append(svg("line", {x1: LEFT, x2: W - RIGHT, y1: y(t), y2: y(t), class: "grid"}));
      root.append(svg("text", {x: LEFT - 6, y: y(t) + 4, class: "tick", "text-anchor": "end"},
                      label(t, step)));
    }
    root.append(svg("text", {x: 12, y: (TOP + H - BOTTOM) / 2, class: "axis-label",
                             transform: `rotate(-90 12 ${(TOP + H - BOTTOM) / 2})`,
                             "text-anchor": "middle"}, yLabel));
    return {root, y};
  }

  function legend(root, names) {
    let x = W - RIGHT;
    for (let i = names.length - 1; i >= 0; i -= 1) {
      const text = svg("text", {x, y: 16, class: "legend", "text-anchor": "end"}, names[i]);
      root.append(text);
      x -= names[i].length * 6.5 + 6;
      root.append(svg("rect", {x: x - 10, y: 7, width: 10, height: 10, fill: COLOURS[i]}));
      x -= 22;
    }
  }

  /** Grouped bars: one group per category, one bar per series ({name, values}). */
  function bars(title, yLabel, categories, series) {
    const values = series.flatMap((s) => s.values).filter(Number.isFinite);
    const {root, y} = frame(title, yLabel, 0, Math.max(...values, 0));
    const slot = (W - LEFT - RIGHT) / categories.length;
    const bar = Math.min(28, (slot * 0.8) / series.length);
    categories.forEach((category, c) => {
      const start = LEFT + slot * c + (slot - bar * series.length) / 2;
      series.forEach((s, i) => {
        const v = s.values[c];
        if (!Number.isFinite(v)) return;
        const rect = svg("rect", {x: start + bar * i, y: y(v), width: bar - 2,
                                  height: Math.max(0, y(0) - y(v)), fill: COLOURS[i],
                                  class: "bar"});
        rect.append(svg("title", {}, `${category}, ${s.name}: ${label(v)}`));
        root.append(rect);
      });
      root.append(svg("text", {x: LEFT + slot * (c + 0.5), y: H - BOTTOM + 16, class: "tick",
                               "text-anchor": "middle"}, category));
    });
    legend(root, series.map((s) => s.name));
    return root;
  }

  /** Lines over 1..n (one per series), with a dot per point. */
  function lines(title, yLabel, xLabel, series) {
    const values = series.flatMap((s) => s.values).filter(Number.isFinite);
    const {root, y} = frame(title, yLabel, Math.min(...values), Math.max(...values));
    const n = Math.max(...series.map((s) => s.values.length));
    const x = (i) => LEFT + (n <= 1 ? 0.5 : i / (n - 1)) * (W - LEFT - RIGHT - 8) + 4;
    series.forEach((s, k) => {
      const points = s.values.map((v, i) => [x(i), y(v)]);
      root.append(svg("polyline", {points: points.map((p) => p.join(",")).join(" "),
                                   stroke: COLOURS[k % COLOURS.length], class: "line"}));
      points.forEach(([px, py], i) => {
        const dot = svg("circle", {cx: px, cy: py, r: 2.5, fill: COLOURS[k % COLOURS.length]});
        dot.append(svg("title", {}, `${s.name}, ${xLabel} ${i + 1}: ${label(s.values[i])}`));
        root.append(dot);
      });
    });
    for (const i of ticks(1, n).filter((t) => t >= 1 && t <= n && Number.isInteger(t))) {
      root.append(svg("text", {x: x(i - 1), y: H - BOTTOM + 16, class: "tick",
                               "text-anchor": "middle"}, String(i)));
    }
    root.append(svg("text", {x: (LEFT + W) / 2, y: H - 8, class: "axis-label",
                             "text-anchor": "middle"}, xLabel));
    legend(root, series.map((s) => s.name).slice(0, COLOURS.length));
    return root;
  }

  return {bars, lines};
})();
