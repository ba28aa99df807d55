// tools/trace_screenshot.js - the README's picture of a --trace file, as chrome://tracing's viewer
// draws it: Catapult's trace2html (github.com/catapult-project/catapult, tracing/bin/trace2html)
// turns the trace into one self-contained HTML page, and this script has Chromium load it and
// take a screenshot once the trace is imported. Needs Debian's chromium and npm's playwright-core.
//
//   python3 catapult/tracing/bin/trace2html results/trace/X.trace.json --output /tmp/x.html
//   node tools/trace_screenshot.js /tmp/x.html results/figures/trace_stage6.png 1600 620 195
//
// Arguments: the page, the PNG, the window's width and height, and the height to keep (0: all).
const { chromium } = require('playwright-core');
(async () => {
  const [inp, out, w, h] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox', '--disable-gpu'] });
  const page = await browser.newPage({ viewport: { width: +(w || 1600), height: +(h || 900) } });
  await page.goto('file://' + inp);
  await page.waitForFunction(() => !document.body.innerText.includes('Importing'), null, { timeout: 60000 });
  await page.waitForTimeout(1500);
  const clipH = +(process.argv[6] || 0);
  await page.screenshot(clipH ? { path: out, clip: { x: 0, y: 0, width: +(w || 1600), height: clipH } } : { path: out });
  await browser.close();
})().catch(e => { console.error(e); process.exit(1); });
