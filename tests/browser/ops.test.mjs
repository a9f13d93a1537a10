// The operator page's view of the whole product (tests/tests/browser.rs prepared the store):
// keys per work state, a queue length beside its holder, the recent events of the keys shown,
// a key's timeline when its key is clicked, and a semaphore (pool/x: 3 holders of 4 slots) as
// one, with a holder force-released from its row. Leaves a screenshot.
//
// Usage: node ops.test.mjs URL SCREENSHOT_PATH  (env LEASEHOLD_BROWSER_TOOLS as page.test.mjs;
// LEASEHOLD_EXPECT: JSON with the fences the test saw)
import { createRequire } from "node:module";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const require = createRequire(join(process.env.LEASEHOLD_BROWSER_TOOLS, "package.json"));
const { chromium } = require("playwright-core");
const [url, screenshot] = process.argv.slice(2);
const expect = JSON.parse(process.env.LEASEHOLD_EXPECT);

function check(ok, what) {
  if (!ok) throw new Error("check failed: " + what);
  console.log("ok " + what);
}

async function until(page, what, f, ms = 10000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) { console.log("ok " + what); return v; }
    if (Date.now() > end) throw new Error("timed out waiting: " + what);
    await page.waitForTimeout(100);
  }
}

const profile = mkdtempSync(join(tmpdir(), "leasehold-chromium-"));
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1280, height: 720 },
});
let code = 0;
try {
  const page = browser.pages()[0] || await browser.newPage();
  await page.goto(url);

  // Keys per work state, with how many are held.
  await until(page, "the work-state counts are shown", async () =>
    (await page.$$eval("#states .stat", (s) => s.map((x) => x.dataset.state))).includes("PENDING"));
  const pending = await page.$eval('#states .stat[data-state="PENDING"]', (s) => s.textContent.trim());
  check(pending === "3PENDING (1 held)", `PENDING shows 3 keys, 1 held: ${JSON.stringify(pending)}`);
  const done = await page.$eval('#states .stat[data-state="DONE"]', (s) => s.textContent.trim());
  check(done === "1DONE (0 held)", `DONE shows 1 key: ${JSON.stringify(done)}`);

  // The queue length beside the holder.
  await until(page, "the queued key is listed", async () => page.isVisible('#rows tr[data-key="jobs/q"]'));
  const q = await page.$eval('#rows tr[data-key="jobs/q"]', (tr) =>
    ({ holder: tr.querySelector("td.holder").textContent, queue: tr.querySelector("td.queue").textContent }));
  check(q.holder === "holder-q" && q.queue === "2", `jobs/q: holder-q with 2 queued (${JSON.stringify(q)})`);

  // The recent events of the keys shown (jobs/t was granted then renewed).
  await until(page, "recent events of jobs/t are listed", async () =>
    (await page.$$eval('#event-items li[data-key="jobs/t"]', (l) => l.map((x) => x.dataset.kind))).includes("renewed"));
  const shown = await page.$$eval("#event-items li", (l) => l.map((x) => x.dataset.key));
  check(!shown.includes("gone/key"), "events of keys not shown are left out");

  // Clicking a key shows its timeline, oldest first, with the fences.
  await page.click('#rows tr[data-key="jobs/t"] td.key');
  await until(page, "the timeline of jobs/t opens", async () => page.isVisible("#timeline-items li"));
  const tl = await page.$$eval("#timeline-items li", (l) => l.map((x) => [x.dataset.kind, x.dataset.fence]));
  check(JSON.stringify(tl) === JSON.stringify(expect.timeline), `jobs/t's timeline ${JSON.stringify(tl)} is ${JSON.stringify(expect.timeline)}`);
  check((await page.textContent("#timeline-title")) === "Timeline of jobs/t", "the timeline names its key");

  // A semaphore as one: 3 of 4 slots, then one row per holder with its fence and time left.
  await until(page, "the semaphore is listed", async () => page.isVisible('#rows tr.semaphore[data-key="pool/x"]'));
  const sem = await page.$eval('#rows tr.semaphore[data-key="pool/x"]', (tr) => tr.querySelector("td.holder").textContent);
  check(sem === "3 of 4 slots", `pool/x shows its slots taken of N: ${JSON.stringify(sem)}`);
  const holders = async () => page.$$eval('#rows tr.slot[data-key="pool/x"]', (rows) => rows.map((r) =>
    [r.querySelector("td.holder").textContent, r.querySelector("td.fence").textContent, r.querySelector("td.left").textContent]));
  const rows = await holders();
  check(JSON.stringify(rows.map((r) => [r[0], r[1]])) === JSON.stringify(expect.pool), `pool/x's holders and fences ${JSON.stringify(rows)}`);
  check(rows.every((r) => /^\d+m \d+s$|^\d+\.\ds$/.test(r[2])), `each holder's time left counts down: ${JSON.stringify(rows)}`);
  // Its timeline: each holder's grant.
  await page.click('#rows tr.semaphore[data-key="pool/x"] td.key');
  await until(page, "the timeline of pool/x opens", async () => (await page.textContent("#timeline-title")) === "Timeline of pool/x");
  const st = await page.$$eval("#timeline-items li", (l) => l.map((x) => [x.dataset.kind, x.dataset.fence]));
  check(JSON.stringify(st) === JSON.stringify(expect.pool.map((p) => ["granted", p[1]])), `pool/x's timeline ${JSON.stringify(st)}`);
  // Force-release of the second holder alone, from its row, behind the confirmation.
  page.once("dialog", (d) => d.accept());
  await page.click(`#rows tr.slot[data-key="pool/x"][data-fence="${expect.pool[1][1]}"] button`);
  await until(page, "the evicted holder leaves the semaphore's rows", async () => (await holders()).length === 2);
  const left = (await holders()).map((r) => r[0]);
  check(JSON.stringify(left) === JSON.stringify(["s1", "s3"]), `s2 evicted, s1 and s3 hold: ${JSON.stringify(left)}`);
  check((await page.$eval('#rows tr.semaphore[data-key="pool/x"] td.holder', (td) => td.textContent)) === "2 of 4 slots",
    "pool/x shows 2 of 4 slots");

  await page.screenshot({ path: screenshot, fullPage: true });
  console.log("SCREENSHOT " + screenshot);
} catch (e) {
  console.log("FAILED " + (e && e.stack || e));
  code = 1;
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
process.exit(code);
