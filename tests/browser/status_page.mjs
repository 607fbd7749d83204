// The coordinator's status page in headless Chromium (Debian's chromium,
// driven by playwright-core; no browser is downloaded). Run by
// tests/integration/test_status.py --part browser:
//   node status_page.mjs BASE_URL OPERATOR_TOKEN JOB WORKER,WORKER CHROMIUM
// Prints PASS/FAIL lines; exits 1 on any failure. Every wait has a timeout.
import { chromium } from 'playwright-core';

const [base, token, job, workerList, executablePath] = process.argv.slice(2);
const workers = workerList.split(',');
let failed = 0;
function check(ok, name, detail) {
  console.log((ok ? 'PASS ' : 'FAIL ') + name + (ok || !detail ? '' : ': ' + detail));
  if (!ok) failed++;
  return ok;
}
const points = (page) => page.$eval('#throughput-plot', (e) => Number(e.dataset.points));

const browser = await chromium.launch({ executablePath, args: ['--no-sandbox'], timeout: 30000 });
try {
  // Without credentials the page is refused (the browser would prompt).
  const anonymous = await browser.newContext();
  // Headless Chromium cannot prompt: a challenge it has no credentials
  // for fails the navigation with ERR_INVALID_AUTH_CREDENTIALS.
  const outcome = await (await anonymous.newPage()).goto(base + '/', { timeout: 15000 })
      .then((r) => 'HTTP ' + r.status(), (e) => String(e.message).split('\n')[0]);
  check(outcome === 'HTTP 401' || outcome.includes('ERR_INVALID_AUTH_CREDENTIALS'),
        'no credentials: the browser is refused (' + outcome + ')', outcome);
  const plain = await anonymous.request.get(base + '/api/jobs', { timeout: 15000 });
  check(plain.status() === 401 &&
        plain.headers()['www-authenticate'] === 'Basic realm="concord"',
        'no credentials: 401 with a Basic challenge (browser request)',
        plain.status() + ' ' + JSON.stringify(plain.headers()));
  await anonymous.close();

  const context = await browser.newContext({
    httpCredentials: { username: 'operator', password: token } });
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  const list = await page.goto(base + '/', { timeout: 15000 });
  check(list.status() === 200, 'the job list loads (HTTP Basic)');
  try {
    await page.waitForSelector(`#jobs a[href="/jobs/${job}"]`, { timeout: 15000 });
    const row = await page.textContent('#jobs');
    check(row.includes('RUNNING'), 'the job list shows the running job', row);
  } catch (e) {
    check(false, 'the job list shows the running job', String(e));
  }
  await page.click(`#jobs a[href="/jobs/${job}"]`);
  await page.waitForURL(base + '/jobs/' + job, { timeout: 10000 });
  try {
    await page.waitForFunction(
        (ws) => { const t = document.querySelector('#members');
                  return t && ws.every((w) => t.textContent.includes(w)); },
        workers, { timeout: 15000 });
    const ranks = await page.$$eval('#members tr',
        (rows) => rows.slice(1).map((r) => r.cells[0].textContent));
    check(ranks.includes('0') && ranks.includes('1'),
        'the job page shows both members with ranks 0 and 1', JSON.stringify(ranks));
  } catch (e) {
    check(false, 'the job page shows both members', String(e));
  }
  const summary = await page.textContent('#summary').catch(() => '');
  check(summary.includes('RUNNING'), 'the job page says RUNNING', summary);
  const first = await points(page);
  try {
    await page.waitForFunction((n) => Number(
        document.querySelector('#throughput-plot').dataset.points) > n + 2, first,
        { timeout: 20000 });
    check(true, 'the throughput plot gains points as steps go (from ' + first + ')');
  } catch (e) {
    check(false, 'the throughput plot gains points', 'stayed at ' + (await points(page)));
  }
  const lossPoints = await page.$eval('#loss-plot', (e) => Number(e.dataset.points));
  const polyline = await page.$('#throughput-plot polyline');
  check(lossPoints > 0 && polyline !== null, 'the loss plot has points (' + lossPoints +
        ') and the throughput plot a line');
  const gens = await page.textContent('#generations').catch(() => '');
  check(gens.includes('running'), 'the generation history lists the running generation', gens);
  check(errors.length === 0, 'no script errors on the page', errors.join('; '));
  await context.close();
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
