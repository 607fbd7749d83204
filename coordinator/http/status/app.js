// The coordinator's status page: polls /api/jobs or /api/jobs/ID once a
// second and redraws. No libraries, no network beyond the coordinator.
'use strict';

const POLL_MS = 1000;
const main = document.getElementById('main');

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) {
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function table(id, headers, rows) {
  const t = el('table', {id});
  t.append(el('tr', {}, ...headers.map((h) => el('th', {}, h))));
  for (const row of rows) {
    t.append(el('tr', {}, ...row.map((c) =>
      typeof c === 'number' ? el('td', {class: 'num'}, c) : el('td', {}, c))));
  }
  return t;
}

function fixed(x, digits) {
  return x === null || x === undefined ? '–' : Number(x).toFixed(digits);
}

function when(ms) {
  return ms === null || ms === undefined ? '–' : new Date(ms).toLocaleTimeString();
}

function stateCell(state) {
  return el('span', {class: 'state-' + state}, state);
}

// A line plot of points [[x, y], ...] in inline SVG.
function plot(id, title, color, points) {
  const W = 480, H = 180, L = 56, R = 10, T = 22, B = 24;
  const svgns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(svgns, 'svg');
  svg.setAttribute('id', id);
  svg.setAttribute('class', 'plot');
  svg.setAttribute('width', W);
  svg.setAttribute('height', H);
  svg.setAttribute('data-points', points.length);
  const text = (x, y, s, anchor) => {
    const t = document.createElementNS(svgns, 'text');
    t.setAttribute('x', x);
    t.setAttribute('y', y);
    if (anchor) t.setAttribute('text-anchor', anchor);
    t.textContent = s;
    svg.append(t);
  };
  text(L, 14, title + (points.length ? '' : ' (no data yet)'));
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y0 > 0 && y0 < 0.5 * y1) y0 = 0;
    if (y1 === y0) { y1 += 1; y0 -= y0 === 0 ? 0 : 1; }
    const sx = (x) => L + (x1 === x0 ? 0 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    const line = document.createElementNS(svgns, 'polyline');
    line.setAttribute('class', 'line');
    line.setAttribute('stroke', color);
    line.setAttribute('points',
        points.map((p) => sx(p[0]).toFixed(1) + ',' + sy(p[1]).toFixed(1)).join(' '));
    svg.append(line);
    const fmt = (v) => Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3);
    text(L - 4, sy(y1) + 4, fmt(y1), 'end');
    text(L - 4, sy(y0) + 4, fmt(y0), 'end');
    text(L, H - 6, ((x1 - x0) / 1000).toFixed(0) + ' s shown');
  }
  return svg;
}

function renderJobs(data) {
  document.getElementById('crumb').textContent = '';
  const rows = data.jobs.map((j) => [
    el('a', {href: '/jobs/' + encodeURIComponent(j.job_id)}, j.job_id),
    stateCell(j.state), j.generation, j.world_size, j.waiting, j.min_workers,
    j.max_workers, j.failure]);
  main.replaceChildren(el('h2', {}, 'Jobs'),
      data.jobs.length ? table('jobs', ['Job', 'State', 'Generation', 'Members',
          'Waiting', 'Min', 'Max', 'Failure'], rows)
          : el('p', {class: 'muted'}, 'No jobs yet.'));
}

// How the coordinator sees a member (docs/reliability.md, "Gray failures").
function health(m) {
  const p = m.progress || {};
  switch (m.health) {
    case 'waiting':
      return `waiting ${fixed((p.pending_ms || 0) / 1000, 1)} s in ` +
          (p.pending_seq ? `#${p.pending_seq} (${p.pending_kind})` : p.pending_kind);
    case 'busy': return 'busy: ' + (p.activity || '');
    case 'slow': return `straggler: own work ${fixed(p.own_ms, 1)} ms a step`;
    case 'idle': return 'idle';
    default: return m.health || '';
  }
}

function renderJob(j) {
  document.getElementById('crumb').textContent = ' / ' + j.job_id;
  const members = j.members.map((m) => [m.rank, m.worker_id, m.host,
    m.committed_step, fixed(m.samples_per_second, 1), fixed(m.loss, 4),
    fixed(m.last_heartbeat_age_ms / 1000, 1) + ' s ago',
    [m.completed ? 'completed' : (m.rank === j.authoritative_rank ? 'authoritative' : ''),
      health(m)].filter((x) => x).join(', ')]);
  for (const m of j.waiting) {
    members.push(['–', m.worker_id, m.host, m.committed_step, '–', '–',
      fixed(m.last_heartbeat_age_ms / 1000, 1) + ' s ago',
      ['waiting', health(m)].filter((x) => x).join(', ')]);
  }
  for (const m of j.expected) {
    members.push(['–', m.worker_id, m.host, m.committed_step, '–', '–',
      fixed(m.last_heartbeat_age_ms / 1000, 1) + ' s ago', 'expected']);
  }
  const gens = j.generations.slice().reverse().map((g) => [g.generation,
    when(g.formed_unix_ms), g.members,
    g.reform_ms === null ? '–' : (g.reform_ms / 1000).toFixed(2) + ' s',
    when(g.ended_unix_ms), g.ended_unix_ms === null ? 'running' : g.end_reason]);
  const pts = j.history.points;
  const summary = el('p', {id: 'summary'}, stateCell(j.state),
      ` generation ${j.generation}, ${j.members.length} member(s) ` +
      `(min ${j.min_workers}, max ${j.max_workers}), ` +
      `${fixed(j.history.steps_per_second, 1)} steps/s, ` +
      `${j.history.failures} failure(s)` + (j.failure ? ' – ' + j.failure : ''));
  main.replaceChildren(
      el('h2', {}, 'Job ' + j.job_id), summary,
      el('div', {class: 'plots'},
          plot('throughput-plot', 'samples/s (all members)', '#1d4ed8',
              pts.map((p) => [p.time_unix_ms, p.samples_per_second])),
          plot('loss-plot', 'loss (mean of members)', '#b45309',
              pts.filter((p) => p.loss !== null).map((p) => [p.time_unix_ms, p.loss]))),
      el('h3', {}, 'Members'),
      table('members', ['Rank', 'Worker', 'Host', 'Step', 'Samples/s', 'Loss',
          'Last heartbeat', 'Note'], members),
      el('h3', {}, 'Generations'),
      table('generations', ['Generation', 'Formed', 'Members', 'Re-form',
          'Ended', 'Reason'], gens),
      el('h3', {}, 'Recent events'),
      table('events', ['Seq', 'Time', 'Kind', 'Worker', 'Message'],
          j.recent_events.slice().reverse().map((e) => [e.seq,
            when(e.time_unix_ms), e.kind, e.worker_id, e.message])));
}

async function poll() {
  const path = window.location.pathname;
  const job = path.startsWith('/jobs/') ? path.slice('/jobs/'.length) : null;
  const url = job === null ? '/api/jobs' : '/api/jobs/' + job;
  try {
    const response = await fetch(url, {cache: 'no-store'});
    if (!response.ok) throw new Error(url + ': ' + (await response.text()));
    const data = await response.json();
    if (job === null) renderJobs(data); else renderJob(data);
    document.getElementById('updated').textContent =
        'updated ' + new Date().toLocaleTimeString();
  } catch (e) {
    main.replaceChildren(el('p', {class: 'error', id: 'error'}, String(e.message || e)));
  }
  setTimeout(poll, POLL_MS);
}

poll();
