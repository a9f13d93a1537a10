// Drives headless Chromium (Debian's /usr/bin/chromium, through playwright-core) over the
// operator page of a running `leasehold serve`. Started by tests/tests/browser.rs, which took
// the leases before and changes them when this script asks (a "STEP ..." line on stdout,
// answered by a line on stdin).
//
// Usage: node page.test.mjs URL SCREENSHOT_PATH   (env LEASEHOLD_BROWSER_TOOLS: the directory
// holding node_modules/playwright-core; LEASEHOLD_SECRETS: lease_ids, one per line, that the
// page must never show)
import { createRequire } from "node:module";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

const require = createRequire(join(process.env.LEASEHOLD_BROWSER_TOOLS, "package.json"));
const { chromium } = require("playwright-core");
const [url, screenshot] = process.argv.slice(2);
const secrets = (process.env.LEASEHOLD_SECRETS || "").split("\n").filter(Boolean);

const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function step(name) {
  console.log("STEP " + name);
  const answer = await lines.next();
  if (answer.done || answer.value.trim() !== "done") throw new Error(`step ${name}: no answer from the test`);
}

function check(ok, what) {
  if (!ok) throw new Error("check failed: " + what);
  console.log("ok " + what);
}

async function keys(page) {
  return page.$$eval("#rows tr", (trs) => trs.map((tr) => tr.dataset.key));
}

async function row(page, key) {
  return page.$eval(`#rows tr[data-key="${key}"]`, (tr) => {
    const t = (c) => tr.querySelector("td." + c).textContent.trim();
    return { key: t("key"), holder: t("holder"), fence: t("fence"), left: t("left"), min_hold: t("min-hold"), fail_closed: t("fail-closed"), keepalive: t("keepalive") };
  });
}

async function until(page, what, f, ms = 5000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) { console.log("ok " + what); return v; }
    if (Date.now() > end) throw new Error("timed out waiting: " + what);
    await page.waitForTimeout(100);
  }
}

function seconds(text) {
  const m = /^(\d+(?:\.\d)?)s$/.exec(text) || /^(\d+)m (\d+)s$/.exec(text);
  if (!m) return NaN;
  return m.length === 3 ? Number(m[1]) * 60 + Number(m[2]) : Number(m[1]);
}

const profile = mkdtempSync(join(tmpdir(), "leasehold-chromium-"));
// A fresh profile (playwright-core passes it as --user-data-dir).
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1280, height: 560 },
});
let code = 0;
try {
  const page = browser.pages()[0] || await browser.newPage();
  const dialogs = [];
  page.on("dialog", async (d) => { dialogs.push(d.message()); await d.accept(); });
  await page.goto(url);

  // The leases the test took before the page opened.
  await until(page, "the page lists the three held keys", async () =>
    JSON.stringify((await keys(page)).sort()) === JSON.stringify(["jobs/a", "jobs/b", "reports/x"]));
  const a = await row(page, "jobs/a");
  check(a.holder === "worker-1" && /^\d+$/.test(a.fence), `jobs/a shows its holder and fence (${a.holder}, ${a.fence})`);
  check(a.min_hold === "—", "jobs/a has no min-hold");
  check(a.fail_closed === "—", "jobs/a is not fail-closed");
  const b = await row(page, "jobs/b");
  check(b.fail_closed === "fail-closed" && b.left === "never", `jobs/b is fail-closed, never expiring (${b.left})`);
  const x = await row(page, "reports/x");
  check(/^until /.test(x.keepalive), `reports/x shows its keep-alive (${x.keepalive})`);
  const mh = seconds(x.min_hold.replace(/ left$/, ""));
  check(/ left$/.test(x.min_hold) && mh > 90 && mh <= 120, `reports/x shows the min-hold left (${x.min_hold})`);
  check((await page.textContent("#count-held")) === "3", "the summary counts 3 held keys");
  check((await page.textContent("#count-fail-closed")) === "1", "the summary counts 1 fail-closed key");

  // The time left counts down between polls.
  const t0 = seconds(a.left);
  await page.waitForTimeout(2100);
  const t1 = seconds((await row(page, "jobs/a")).left);
  check(t0 > 20 && t0 <= 60 && t0 - t1 >= 1.5 && t0 - t1 <= 3.5, `the time left counts down (${t0}s -> ${t1}s)`);

  // The test releases jobs/a and takes jobs/c through the HTTP API: the page follows.
  await step("release jobs/a, acquire jobs/c");
  await until(page, "jobs/a is gone and jobs/c appears", async () => {
    const k = await keys(page);
    return !k.includes("jobs/a") && k.includes("jobs/c");
  });

  // The prefix filter.
  await page.fill("#prefix", "jobs/");
  await until(page, "the prefix jobs/ shows only jobs/ keys", async () =>
    JSON.stringify((await keys(page)).sort()) === JSON.stringify(["jobs/b", "jobs/c"]));
  await page.fill("#prefix", "nothing/");
  await until(page, "a prefix nothing matches shows none and says so", async () =>
    (await keys(page)).length === 0 && (await page.isVisible("#empty")));
  await page.fill("#prefix", "");
  await until(page, "clearing the filter shows every key", async () => (await keys(page)).length === 3);

  const first = screenshot.replace(/\.png$/, "-held.png");
  await page.screenshot({ path: first, fullPage: true });
  console.log("SCREENSHOT " + first);

  // Force-release behind a confirmation: accepted, the fence advances and the row goes.
  const before = BigInt((await row(page, "jobs/b")).fence);
  await page.click('#rows tr[data-key="jobs/b"] button');
  await until(page, "the force-release is reported", async () => page.isVisible('#log li[data-key="jobs/b"]'));
  check(dialogs.length === 1 && dialogs[0].includes("jobs/b") && dialogs[0].includes("worker-2"), `a confirmation named the key and holder: ${JSON.stringify(dialogs)}`);
  const after = BigInt(await page.getAttribute('#log li[data-key="jobs/b"]', "data-fence"));
  check(after > before, `the page shows the new fence (${before} -> ${after})`);
  await until(page, "jobs/b is gone", async () => !(await keys(page)).includes("jobs/b"));

  // No lease_id ever reaches the page.
  const html = await page.content();
  check(!html.includes("lease_id"), "the page's HTML has no lease_id field");
  for (const s of secrets) check(!html.includes(s), "the page's HTML does not contain a lease_id the test holds");

  await page.screenshot({ path: screenshot, fullPage: true });
  console.log("SCREENSHOT " + screenshot);
  console.log("RESULT " + JSON.stringify({ force_released: "jobs/b", fence: after.toString() }));
} catch (e) {
  console.log("FAILED " + (e && e.stack || e));
  code = 1;
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
process.exit(code);
