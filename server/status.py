"""The status page at ``/``: throughput, utilisation and cost per token per decoder over time.

A single self-contained HTML page (no external assets: deployments are often
air-gapped) that polls ``/status.json`` and draws three small line charts on
canvases. The page itself is open; its data is not: with ``--api-key`` set, the
page asks for the key once and keeps it in the tab's session storage. While step graphs
are built, a line under the title says how many are built of how many and which builds now
(``compile_status``, from the compile worker's ``progress``).
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dualserve status</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 24px; color: #1d2330; background: #f7f8fa; }
 h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #5b6475; margin-bottom: 18px; }
 .grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(360px, 1fr)); gap: 16px; }
 .card { background: #fff; border: 1px solid #dde1e8; border-radius: 8px; padding: 12px 14px; }
 .card h2 { font-size: 14px; margin: 0 0 8px; } canvas { width: 100%; height: 180px; }
 table { border-collapse: collapse; width: 100%; } td, th { padding: 4px 8px; text-align: left;
 border-bottom: 1px solid #eef0f4; } .legend span { margin-right: 12px; }
</style></head>
<body>
<h1>dualserve</h1>
<div class="sub" id="summary">models: __MODELS__ &middot; node cost: __COST__</div>
<div class="sub" id="compile" hidden></div>
<div class="sub" id="threads" hidden></div>
<form id="keyform" hidden>This server needs its API key: <input id="key" type="password" autocomplete="off">
 <button>Show</button></form>
<div class="grid">
 <div class="card"><h2>Throughput (tokens / busy second)</h2><canvas id="tput"></canvas><div class="legend" id="lg1"></div></div>
 <div class="card"><h2>Utilisation and KV pool usage</h2><canvas id="util"></canvas><div class="legend" id="lg2"></div></div>
 <div class="card"><h2>Cost per 1M tokens</h2><canvas id="cost"></canvas><div class="legend" id="lg3"></div></div>
 <div class="card"><h2>Now</h2><table id="now"><tr><th>decoder</th><th>tok/s</th><th>cost / 1M</th></tr></table></div>
</div>
<script>
const COLORS = {ar: "#3566d6", eagle: "#d6761e", diffusion: "#2f9e62", utilisation: "#7a3fd1", pool: "#999"};
function draw(id, series, legend, fmt) {
  const c = document.getElementById(id), ctx = c.getContext("2d");
  c.width = c.clientWidth * 2; c.height = c.clientHeight * 2; ctx.scale(2, 2);
  const w = c.clientWidth, h = c.clientHeight, pad = 28;
  ctx.clearRect(0, 0, w, h);
  let max = 0, n = 0;
  for (const s of Object.values(series)) { for (const v of s) { if (v != null) max = Math.max(max, v); } n = Math.max(n, s.length); }
  max = max || 1;
  ctx.strokeStyle = "#dde1e8"; ctx.fillStyle = "#5b6475"; ctx.font = "10px system-ui";
  for (let i = 0; i <= 4; i++) { const y = pad / 2 + (h - pad) * i / 4; ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(fmt(max * (1 - i / 4)), 0, y + 3); }
  let html = "", drawn = 0;
  for (const [name, s] of Object.entries(series)) {
    const color = COLORS[name] || "#333"; ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
    s.forEach((v, i) => { if (v == null) return; const x = pad + (w - pad) * i / Math.max(n - 1, 1);
      const y = pad / 2 + (h - pad) * (1 - v / max); i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); drawn++; });
    ctx.stroke(); html += `<span style="color:${color}">&#9632; ${name}</span>`;
  }
  document.getElementById(legend).innerHTML = html;
  c.dataset.points = drawn;  // how many data points the chart drew (the browser test reads it)
}
document.getElementById("keyform").onsubmit = e => { e.preventDefault();
  sessionStorage.setItem("dualserve-key", document.getElementById("key").value); refresh(); };
async function refresh() {
  const key = sessionStorage.getItem("dualserve-key");
  const r = await fetch("status.json", key ? {headers: {Authorization: "Bearer " + key}} : {});
  document.getElementById("keyform").hidden = r.status !== 401;
  if (!r.ok) return;
  const data = await r.json(); const hist = data.history;
  const c = data.compile, line = document.getElementById("compile");
  line.hidden = !c;
  if (c) line.textContent = `compiling step graphs: ${c.built} of ${c.total} built` +
    (c.building ? `, building ${c.building}` : "") + "; a shape runs eagerly until its graph is ready";
  const t = data.threads, tl = document.getElementById("threads");
  tl.hidden = !t || t.team === t.threads;
  if (t) tl.textContent = `other programs use ${t.neighbour_load} of ${t.cpus} cores: steps run on ${t.team} of ${t.threads} threads`;
  const decoders = new Set(); hist.forEach(p => Object.keys(p.decoders).forEach(d => decoders.add(d)));
  const tput = {}, cost = {};
  decoders.forEach(d => { tput[d] = hist.map(p => p.decoders[d] ? p.decoders[d].tokens_per_second : 0);
                          cost[d] = hist.map(p => p.decoders[d] ? p.decoders[d].cost_per_million_tokens : null); });
  draw("tput", tput, "lg1", v => v.toFixed(1));
  draw("util", {utilisation: hist.map(p => p.utilisation), pool: hist.map(p => p.pool_usage)}, "lg2", v => v.toFixed(2));
  draw("cost", cost, "lg3", v => v.toFixed(2));
  const last = hist.length ? hist[hist.length - 1].decoders : {};
  let rows = "<tr><th>decoder</th><th>tok/s</th><th>cost / 1M</th></tr>";
  for (const [d, v] of Object.entries(last)) rows += `<tr><td>${d}</td><td>${v.tokens_per_second}</td><td>${v.cost_per_million_tokens ?? "-"}</td></tr>`;
  document.getElementById("now").innerHTML = rows;
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""


def render_page(models: list[str], node_cost_per_hour: float) -> str:
    cost = (f"{node_cost_per_hour:g} per hour" if node_cost_per_hour
            else "not set &mdash; start with --node-cost-per-hour N to see cost per token")
    return PAGE.replace("__MODELS__", ", ".join(models)).replace("__COST__", cost)


def compile_status(progress) -> dict | None:
    """``/status.json``'s ``compile`` entry from ``CompileWorker.progress()``: graphs built and
    asked for since the queue last ran dry, and the one building now; None while none is asked for."""
    if progress is None or not progress.total:
        return None
    return {"built": progress.done, "total": progress.total, "building": progress.running}
