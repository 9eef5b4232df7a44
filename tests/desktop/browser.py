"""A person's browser on `boxery desktop`'s link (tests/real_vms/desktop.rs): Debian's chromium,
headless, driven by Playwright. It opens the link, waits until noVNC's canvas shows the guest's
screen at WIDTHxHEIGHT with a pixel of colour RGB on it (the test's app), saves the canvas as a
PNG, and then, when asked, clicks at a point given in the screen's own pixels.

usage: browser.py URL OUT.png WIDTHxHEIGHT RRGGBB [X,Y]
Prints one JSON line: {"status": first answer's HTTP status, "final": the page's URL}.
"""

import base64
import json
import sys
import time

from playwright.sync_api import sync_playwright

url, out, size, colour = sys.argv[1:5]
click = [int(v) for v in sys.argv[5].split(",")] if len(sys.argv) > 5 else None
want_w, want_h = (int(v) for v in size.split("x"))
rgb = [int(colour[i : i + 2], 16) for i in (0, 2, 4)]

SHOWN = """([w, h, r, g, b]) => {
  const c = document.querySelector('canvas');
  if (!c || c.width !== w || c.height !== h) return false;
  const d = c.getContext('2d').getImageData(0, 0, w, h).data;
  for (let i = 0; i < d.length; i += 4)
    if (d[i] === r && d[i + 1] === g && d[i + 2] === b) return true;
  return false;
}"""

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        first = page.goto(url)
        status = first.status if first else 0
        if status != 200:
            print(json.dumps({"status": status, "final": page.url}))
            sys.exit(0)
        page.wait_for_function(SHOWN, arg=[want_w, want_h, *rgb], timeout=120_000, polling=250)
        data = page.evaluate("() => document.querySelector('canvas').toDataURL('image/png')")
        with open(out, "wb") as f:
            f.write(base64.b64decode(data.split(",", 1)[1]))
        if click:
            box = page.evaluate(
                "() => { const c = document.querySelector('canvas'); const r = c.getBoundingClientRect();"
                " return [r.x, r.y, r.width / c.width, r.height / c.height]; }"
            )
            x0, y0, sx, sy = box
            page.mouse.click(x0 + click[0] * sx, y0 + click[1] * sy)
            time.sleep(1.5)
        print(json.dumps({"status": status, "final": page.url}))
    finally:
        browser.close()
