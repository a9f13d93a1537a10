// The operator page's view of the whole product (tests/tests/browser.rs prepared the store):
// keys per work state, a queue length beside its holder, the recent events of the keys shown,
// and a key's timeline when its key is clicked. Leaves a screenshot.
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
