/* Small wrappers around uPlot (MIT, shipped in /static): responsive line charts whose figure carries
 * data-points and an aria-label summary, so screen readers and tests can read what is drawn. */
"use strict";

window.E2Charts = (function () {
  const COLORS = ["#1f6feb", "#c2410c", "#15803d", "#7c3aed", "#b91c1c"];

  /**
   * figure: <figure class="chart"> holding a .plot div.
   * spec: { series: [{label, color, dash, band}], time: bool (x = unix seconds, else step),
   *         y: {min, max} fixed range, format: v => text, describe: (xs, ys) => text }
   */
  function line(figure, spec) {
    const plotEl = figure.querySelector(".plot");
    const empty = E2.h("p", { class: "chart-empty muted" }, spec.empty || "No steps reported yet.");
    figure.append(empty);
    const series = [{ label: spec.time ? "Time" : "Step", value: spec.time ? undefined : (u, v) => v ?? "–" }];
    spec.series.forEach((s, i) => series.push({
      label: s.label,
      stroke: s.color || COLORS[i % COLORS.length],
      width: s.width || 2,
      dash: s.dash,
      scale: s.scale || "y",
      spanGaps: true,
      points: { size: 5 },
      value: (u, v) => (v === null || v === undefined ? "–" : (spec.format || defaultFormat)(v)),
    }));
    const axes = [
      { label: spec.time ? undefined : "step", values: spec.time ? undefined : integerTicks },
      { size: 56, values: (u, vals) => vals.map((v) => (spec.format || defaultFormat)(v)) },
    ];
    const scales = { x: { time: !!spec.time } };
    scales.y = { range: (u, min, max) => yRange(spec.y || {}, min, max) };
    if (spec.series.some((s) => s.scale === "y2")) {
      axes.push({ scale: "y2", side: 1, size: 56, grid: { show: false }, values: (u, vals) => vals.map((v) => defaultFormat(v)) });
    }
    const opts = {
      width: Math.max(plotEl.clientWidth, 200),
      height: 220,
      series,
      axes,
      scales,
      bands: spec.bands,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      // Without a hovered point, the legend shows the latest values instead of dashes.
      hooks: { setCursor: [(u) => { if (u.cursor.idx === null && u.data[0].length) u.setLegend({ idx: u.data[0].length - 1 }); }] },
    };
    const data = [[], ...spec.series.map(() => [])];
    const plot = new uPlot(opts, data, plotEl);
    const resize = new ResizeObserver(() => {
      const width = Math.max(plotEl.clientWidth, 200);
      if (Math.abs(width - plot.width) > 2) plot.setSize({ width, height: 220 });
    });
    resize.observe(plotEl);

    return {
      /** columns: [xs, ys1, ys2, ...] */
      set(columns) {
        plot.setData(columns);
        if (columns[0].length && plot.cursor.idx === null) plot.setLegend({ idx: columns[0].length - 1 });
        const n = columns[0].length;
        figure.dataset.points = String(n);
        empty.hidden = n > 0;
        plotEl.setAttribute("aria-label", spec.describe ? spec.describe(columns) : summary(columns));
      },
    };

    function summary(columns) {
      const n = columns[0].length;
      if (!n) return `${figure.querySelector("figcaption").textContent}: no data yet.`;
      const last = spec.series.map((s, i) => `${s.label} ${(spec.format || defaultFormat)(columns[i + 1][n - 1])}`);
      const where = spec.time ? "latest" : `at step ${columns[0][n - 1]}`;
      return `${figure.querySelector("figcaption").textContent}: ${n} points; ${where}: ${last.join(", ")}.`;
    }
  }

  /** A y range that is never empty (a flat series would otherwise draw nothing), honouring fixed ends. */
  function yRange(fixed, min, max) {
    if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) {
      return [fixed.min ?? 0, fixed.max ?? 1];
    }
    if (max - min < 1e-12) {
      const pad = Math.abs(max) * 0.5 || 1;
      min -= pad;
      max += pad;
    }
    const [lo, hi] = uPlot.rangeNum(min, max, 0.1, true);
    return [fixed.min ?? lo, fixed.max !== undefined ? Math.max(fixed.max, max) : hi];
  }

  function integerTicks(u, vals) { return vals.map((v) => (Number.isInteger(v) ? String(v) : "")); }

  function defaultFormat(v) {
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a < 0.001 || a >= 1e6)) return v.toExponential(1);
    return String(Number(v.toPrecision(3)));
  }

  return { line, COLORS };
})();
