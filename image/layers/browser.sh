#!/bin/bash
# browser layer (root, idempotent): a browser the agent drives (boxery's `vm_browser`, `boxery
# browser`), on the desktop layer's display, so a person sees it (`boxery desktop`) and the
# computer-use actions reach it too. Debian 12 packages only: chromium (kept current by
# Debian's security updates), dbus-user-session; and firefox-esr, for people and agents who
# test in Firefox (on the desktop, or `firefox-esr --headless --screenshot`; not driven by
# `vm_browser`). Both read the egress proxy from a login shell's environment.
#   /usr/local/lib/boxery/browser/drive   one action, a JSON request on stdin, a JSON answer on
#                                         stdout (run as agent); starts the browser when it is
#                                         not running: chromium on :0, its DevTools endpoint on
#                                         the guest's 127.0.0.1 only, on a port the kernel picks
#                                         (Chromium writes it in the profile's DevToolsActivePort:
#                                         no fixed port to collide with a developer's own), its
#                                         profile in ~/.cache/boxery-browser, going out through the egress
#                                         proxy of /run/boxery/env (the guest's policy applies)
# Needs the desktop layer (boxery adds it with this one). Not added to a running VM (packages):
# make the VM with it. `browser.sh --print-packages` prints the packages.
set -euo pipefail
# (The driver speaks to Chromium's DevTools over a plain socket: the base image's python3 only.)
# dbus-user-session: chromium's dconf-service needs a session bus, a virtual package that
# debootstrap does not resolve by itself
PACKAGES="chromium firefox-esr dbus-user-session"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "browser: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "$0")/lib.sh"
install_missing browser $PACKAGES
D=/usr/local/lib/boxery/browser
install -d -m 0755 "$D"
# The driver. Exit codes as boxery's guest helpers read them: 0 done (the answer on stdout), 3 not
# found (no element matches the selector), 4 invalid (a request it cannot do), 1 failed; the
# message on stderr.
cat > "$D/drive" <<'EOS'
#!/usr/bin/python3
"""drive: one browser action (the browser layer's header). Request on stdin, JSON:
{"action": "open"|"read"|"click"|"fill"|"evaluate"|"screenshot", "url", "selector", "text",
 "expression", "timeout"}; answer on stdout, JSON. Only small modules are imported (urllib or a
websocket library cost seconds of a call under emulation): HTTP and the websocket to Chromium's
DevTools endpoint are spoken over a plain socket."""
import binascii, json, os, socket, sys, time

HOME = os.path.expanduser("~")
PROFILE = os.path.join(HOME, ".cache", "boxery-browser")
# where Chromium writes the DevTools port it was given (`--remote-debugging-port=0`)
ACTIVE_PORT = os.path.join(PROFILE, "DevToolsActivePort")
LOG = os.path.join(HOME, ".cache", "boxery-browser.log")
# the browser's relay to the egress proxy: "PORT PID" (written by the relay)
RELAY = os.path.join(HOME, ".cache", "boxery-browser.relay")
# the relay's port the running browser was started with (--proxy-server)
LAUNCHED = RELAY + ".browser"
# the tab every call acts on (a tab a page opens does not take the calls over)
TAB = os.path.join(HOME, ".cache", "boxery-browser.tab")
TEXT_CAP = 256 * 1024


def fail(code, msg):
    print(msg, file=sys.stderr)
    sys.exit(code)


def answer(out):
    """The answer on stdout: JSON in UTF-8 (a page's lone surrogates replaced, which JSON
    parsers refuse)."""
    sys.stdout.buffer.write(json.dumps(out, ensure_ascii=False).encode("utf-8", "replace"))
    sys.stdout.buffer.write(b"\n")


req = json.load(sys.stdin)
action = req.get("action")
deadline = time.monotonic() + float(req["timeout"])  # (the host always sends it)


def left():
    return max(0.5, deadline - time.monotonic())


def port():
    """The running browser's DevTools port, from its profile; OSError while there is none."""
    with open(ACTIVE_PORT) as f:
        p = f.readline().strip()
    if not p.isdigit() or not 0 < int(p) < 65536:
        raise OSError(f"no DevTools port in {ACTIVE_PORT} yet")
    return int(p)


def endpoint(path, method="GET", probe=False):
    """GET (or PUT) a DevTools JSON endpoint; OSError when it does not answer 200 (a probe
    waits 2 s at most; otherwise the call's time: a browser just started answers slowly)."""
    p = port()
    with socket.create_connection(("127.0.0.1", p), timeout=min(2, left()) if probe else left()) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\nConnection: close\r\n\r\n".encode())
        # (read to the body's length: the endpoint keeps the connection open)
        data = bytearray()
        while b"\r\n\r\n" not in data:
            b = s.recv(65536)
            if not b:
                break
            data += b
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        if len(parts) < 2 or parts[1] != b"200":
            raise OSError(f"DevTools {path}: {head[:80]!r}")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v.strip())
        body = bytearray(body)
        while len(body) < length:
            b = s.recv(65536)
            if not b:
                break
            body += b
    return json.loads(bytes(body[:length]) if length else bytes(body))


class WebSocket:
    """A client websocket (RFC 6455) on a plain socket: text frames, masked; pings answered."""

    def __init__(self, url):
        hostport, _, path = url[len("ws://"):].partition("/")
        host, _, port = hostport.rpartition(":")
        self.s = socket.create_connection((host, int(port)), timeout=left())
        key = binascii.b2a_base64(os.urandom(16)).strip().decode()
        self.s.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                        "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buf = bytearray()
        while b"\r\n\r\n" not in self.buf:
            self.more()
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        if b" 101 " not in head.split(b"\r\n")[0] + b" ":
            fail(1, f"the browser refused its DevTools websocket: {head[:120]!r}")
        self.buf = bytearray(rest)
        self.parts = []

    def more(self, within=None):
        """Read more; past `within` seconds raise socket.timeout, else fail at the deadline."""
        self.s.settimeout(within if within is not None else left())
        try:
            b = self.s.recv(1 << 20)
        except socket.timeout:
            if within is not None:
                raise
            fail(1, "the browser did not answer within the call's time")
        if not b:
            fail(1, "the browser closed its DevTools connection")
        self.buf += b

    def whole(self):
        """The length of the frame at the buffer's start when it is all there, else 0."""
        if len(self.buf) < 2:
            return 0
        n, off = self.buf[1] & 0x7F, 2
        if n == 126:
            if len(self.buf) < 4:
                return 0
            n, off = int.from_bytes(self.buf[2:4], "big"), 4
        elif n == 127:
            if len(self.buf) < 10:
                return 0
            n, off = int.from_bytes(self.buf[2:10], "big"), 10
        if self.buf[1] & 0x80:
            off += 4
        return off + n if len(self.buf) >= off + n else 0

    def frame(self, opcode, data):
        n = len(data)
        head = bytearray([0x80 | opcode])
        if n < 126:
            head.append(0x80 | n)
        elif n < 65536:
            head.append(0x80 | 126)
            head += n.to_bytes(2, "big")
        else:
            head.append(0x80 | 127)
            head += n.to_bytes(8, "big")
        mask = os.urandom(4)
        key = (mask * (n // 4 + 1))[:n]
        body = (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big") if n else b""
        self.s.sendall(bytes(head) + mask + body)

    def send(self, text):
        self.frame(0x1, text.encode())

    def recv(self, within=None):
        """The next message (a whole frame is read before any of it is taken, so a timeout
        leaves the stream as it was)."""
        while True:
            size = self.whole()
            while not size:
                self.more(within)
                size = self.whole()
            f = bytes(self.buf[:size])
            del self.buf[:size]
            b0, b1 = f[0], f[1]
            n, off = b1 & 0x7F, 2
            if n == 126:
                off = 4
            elif n == 127:
                off = 10
            mask = None
            if b1 & 0x80:
                mask, off = f[off:off + 4], off + 4
            data = f[off:]
            if mask:
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
            op = b0 & 0x0F
            if op == 0x9:
                self.frame(0xA, data)
                continue
            if op == 0x8:
                fail(1, "the browser closed its DevTools connection")
            if op in (0x1, 0x2, 0x0):
                self.parts.append(data)
                if b0 & 0x80:
                    whole, self.parts = b"".join(self.parts), []
                    return whole.decode("utf-8", "replace")


def proxy_env():
    """The egress proxy and the hosts to reach directly, from /run/boxery/env (pushed by the
    control plane), as a shell sees them."""
    import subprocess
    if not os.access("/run/boxery/env", os.R_OK):
        return "", ""
    out = subprocess.run(["sh", "-c", '. /run/boxery/env >/dev/null 2>&1; printf "%s\\n%s" "${http_proxy:-}" "${no_proxy:-}"'],
                         capture_output=True, text=True, timeout=10)
    proxy, _, direct = out.stdout.partition("\n")
    return proxy.strip(), direct.strip()


def proxy_said(url):
    """What the egress proxy answers a tunnel to `url`'s host (Chromium shows only
    ERR_TUNNEL_CONNECTION_FAILED): its status line, which says why (': the proxy said 403
    Forbidden: … is not in VM …'s egress allow list'), or nothing."""
    from urllib.parse import unquote, urlsplit
    proxy, _ = proxy_env()
    try:
        u, p = urlsplit(url), urlsplit(proxy)
        host = f"[{u.hostname}]" if ":" in (u.hostname or "") else u.hostname
        target = f"{host}:{u.port or 443}"
        auth = ""
        if p.password:  # a shared listener's: the VM's token as the proxy password
            cred = binascii.b2a_base64(f"{unquote(p.username or '')}:{unquote(p.password)}".encode(), newline=False).decode()
            auth = f"Proxy-Authorization: Basic {cred}\r\n"
        with socket.create_connection((p.hostname, p.port or 80), timeout=min(5, left())) as s:
            s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())
            line = s.makefile("rb").readline(1024).decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return ""
    parts = line.split(" ", 1)
    if len(parts) < 2 or parts[1].startswith("200"):
        return ""
    return f": the egress proxy said {''.join(c if c.isprintable() else '?' for c in parts[1])}"


def display_size():
    import subprocess
    try:
        out = subprocess.run(["xdpyinfo", "-display", ":0"], capture_output=True, text=True,
                             timeout=10).stdout
        for line in out.splitlines():
            if "dimensions:" in line:
                w, h = line.split()[1].split("x")
                return int(w), int(h)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return 1280, 800


def relay_running():
    """The running relay's port, else None."""
    try:
        with open(RELAY) as f:
            port, pid = (int(x) for x in f.read().split())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"/browser/relay" in f.read():
                return port
    except (OSError, ValueError):
        pass
    return None


def launched_relay():
    """The relay's port the running browser was started with (None: started without one)."""
    try:
        with open(LAUNCHED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def start_relay(port):
    """Start the relay on `port` (None: one the kernel picks); its port."""
    import subprocess
    try:
        os.unlink(RELAY)
    except FileNotFoundError:
        pass
    args = ["/usr/local/lib/boxery/browser/relay", RELAY] + ([str(port)] if port else [])
    with open(LOG, "ab") as log:
        relay = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True)
    # waited for as long as the call may take, not a guess: a guest under load (TCG, a busy
    # host) can take many seconds to start Python; a relay that ends is reported at once
    while time.monotonic() < deadline:
        got = relay_running()
        if got:
            return got
        code = relay.poll()
        if code is not None:
            said = log_tail()
            if port:
                fail(1, f"the browser's relay to the egress proxy could not take its port {port} again (it ended with {code}{said}): close the browser (pkill -u agent -x chromium) and call again (its log: {LOG})")
            fail(1, f"the browser's relay to the egress proxy ended with {code}{said} (its log: {LOG})")
        time.sleep(0.05)
    fail(1, f"the browser's relay to the egress proxy did not start within the call's time: call again with a longer timeout (its log: {LOG})")


def log_tail():
    """The log's last line, as ': LINE' (printable only), or nothing."""
    try:
        with open(LOG, "rb") as f:
            f.seek(max(0, os.path.getsize(LOG) - 4096))
            lines = [l for l in f.read().decode("utf-8", "replace").splitlines() if l.strip()]
    except OSError:
        return ""
    if not lines:
        return ""
    return ": " + "".join(c if c.isprintable() else "?" for c in lines[-1])[:300]


def browser_pid():
    """The Chromium that holds the profile (its SingletonLock names it), when it runs."""
    try:
        pid = os.readlink(os.path.join(PROFILE, "SingletonLock")).rpartition("-")[2]
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            if b"chromium" in f.read():
                return int(pid)
    except (OSError, ValueError):
        pass
    return None


def start():
    """The browser's DevTools endpoint, the browser started when it does not run (and its
    relay when that is gone); waited for. Calls at once start one browser: what is started is
    started under a lock beside the profile."""
    try:
        version = endpoint("/json/version", probe=True)
        want = launched_relay()
        if want is None or relay_running() == want:
            return version
    except OSError:
        pass
    import fcntl
    os.makedirs(PROFILE, exist_ok=True)
    lock = open(PROFILE + ".lock", "w")
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                fail(1, "another call is starting the browser: try again")
            time.sleep(0.1)
    try:
        return launch()
    finally:
        lock.close()


def wait_endpoint(why):
    while time.monotonic() < deadline:
        try:
            return endpoint("/json/version", probe=True)
        except OSError:
            time.sleep(0.25)
    fail(1, why)


def launch():
    """Under start's lock: a running browser's relay back on its port; else a new browser
    (with its relay, when the guest has an egress proxy)."""
    import subprocess
    if browser_pid() is not None:
        # running (slow to answer, or its relay gone): never a second one
        want = launched_relay()
        if want is not None and relay_running() != want:
            start_relay(want)
        return wait_endpoint(f"the browser runs but its DevTools endpoint did not answer within the call's time: call again, or close it (pkill -u agent -x chromium) (its log: {LOG})")
    # a browser that is gone left its port and relay port behind: the new one writes its own
    for stale in (ACTIVE_PORT, LAUNCHED):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    w, h = display_size()
    proxy, direct = proxy_env()
    args = ["chromium", f"--user-data-dir={PROFILE}", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-features=Translate,MediaRouter,OptimizationHints", "--password-store=basic",
            "--disable-session-crashed-bubble", "--hide-crash-restore-bubble",
            "--window-position=0,0", f"--window-size={w},{h}"]
    # (Chromium reaches loopback directly by itself; `<-loopback>` would send it to the proxy)
    if proxy:
        # through the relay: it adds the proxy's credentials (Chromium cannot send those from
        # --proxy-server) and follows a new proxy in /run/boxery/env
        port = relay_running() or start_relay(None)
        tmp = LAUNCHED + ".new"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, LAUNCHED)
        args.append(f"--proxy-server=http://127.0.0.1:{port}")
        hosts = [h.strip() for h in direct.split(",") if h.strip()]
        if hosts:
            args.append("--proxy-bypass-list=" + ";".join(hosts))
    args.append("about:blank")
    env = dict(os.environ, DISPLAY=":0")
    with open(LOG, "ab") as log:
        subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                         start_new_session=True)
    return wait_endpoint(f"the browser did not start within the call's time (its log: {LOG})")


def the_tab():
    """The tab the calls act on: the one used before while it is open, else the first (or a
    new one), remembered."""
    pages = [t for t in endpoint("/json/list") if t.get("type") == "page"]
    try:
        with open(TAB) as f:
            kept = f.read().strip()
    except OSError:
        kept = ""
    tab = next((t for t in pages if t.get("id") == kept), None)
    if tab is None:
        tab = pages[-1] if pages else endpoint("/json/new?about:blank", "PUT")
        tmp = TAB + ".new"
        with open(tmp, "w") as f:
            f.write(tab.get("id", ""))
        os.replace(tmp, TAB)
    return tab


class Page:
    def __init__(self):
        start()
        self.ws = WebSocket(the_tab()["webSocketDebuggerUrl"])
        self.n = 0
        self.events = []
        # boxery's own scripts run in a world of their own: a page's scripts cannot change
        # what they read or where a click goes (the page's own world is for `evaluate`)
        self.world = None
        # the tab acted on is the one shown (a tab in the background draws no picture)
        self.call("Page.bringToFront")

    def send(self, method, **params):
        """Send one DevTools call; its id."""
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        return self.n

    def reply(self, me, until=None):
        """The answer to call `me`: (its result, None) or (None, the browser's error message);
        socket.timeout past `until` (else a failure at the call's deadline)."""
        while True:
            within = None if until is None else max(0.05, until - time.monotonic())
            msg = json.loads(self.ws.recv(within))
            if "method" in msg:
                # (an event: kept for event(), which may be waiting for it)
                self.events.append(msg["method"])
                continue
            if msg.get("id") == me:
                if "error" in msg:
                    return None, msg["error"].get("message") or "an error"
                return msg.get("result", {}), None

    def request(self, method, **params):
        """One DevTools call: (its result, None) or (None, the browser's error message)."""
        return self.reply(self.send(method, **params))

    def call(self, method, **params):
        r, err = self.request(method, **params)
        if err is not None:
            fail(1, f"{method}: {err}")
        return r

    def isolated(self):
        if self.world is None:
            frame = self.call("Page.getFrameTree")["frameTree"]["frame"]["id"]
            self.world = self.call("Page.createIsolatedWorld", frameId=frame, worldName="boxery",
                                   grantUniveralAccess=False)["executionContextId"]
        return self.world

    def js(self, expression, page_world=False):
        """Evaluate `expression` (in boxery's world, or the page's own): (its value, None) or
        (None, why). A script still running near the call's deadline is stopped (V8's own
        timeout, and Runtime.terminateExecution, which the browser takes while the page is
        busy)."""
        stop_at = deadline - 4
        params = dict(expression=expression, returnByValue=True, awaitPromise=True,
                      timeout=int(max(0.5, stop_at - time.monotonic()) * 1000))
        r, err = None, "the page kept changing under the action"
        for _ in range(3):
            if not page_world:
                params["contextId"] = self.isolated()
            me = self.send("Runtime.evaluate", **params)
            try:
                r, err = self.reply(me, until=stop_at)
            except socket.timeout:
                self.send("Runtime.terminateExecution")
                try:
                    self.reply(me, until=deadline - 0.5)
                except socket.timeout:
                    fail(1, "the expression ran past the action's time and could not be stopped")
                fail(1, "the expression ran past the action's time and was stopped")
            if err is None or page_world or "context" not in err.lower():
                break
            self.world = None  # (a navigation destroyed it: made again)
        if err is not None:
            if time.monotonic() >= stop_at - 0.5:
                fail(1, "the expression ran past the action's time and was stopped")
            fail(1, f"Runtime.evaluate: {err}")
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            what = (d.get("exception") or {}).get("description") or d.get("text")
            return None, str(what)
        return (r.get("result") or {}).get("value"), None

    def event(self, names, within):
        """Wait up to `within` seconds for one of the events `names` (Page.enable first);
        its name, or None."""
        for i, seen in enumerate(self.events):
            if seen in names:
                del self.events[:i + 1]
                return seen
        self.events.clear()
        end = min(deadline, time.monotonic() + within)
        while time.monotonic() < end:
            try:
                msg = json.loads(self.ws.recv(max(0.05, end - time.monotonic())))
            except socket.timeout:
                return None
            if msg.get("method") in names:
                return msg["method"]
        return None

    def settle(self):
        """Wait until the page has loaded (readyState complete), keeping 3 s of the call's
        time; whether it did (if not, its loading is stopped)."""
        while True:
            state, _ = self.js("document.readyState")
            if state == "complete":
                return True
            if time.monotonic() >= deadline - 3:
                break
            time.sleep(0.2)
        self.call("Page.stopLoading")
        return False

    def state(self, text=True):
        """The page's address, title and status, and its text when asked (innerText lays the
        page out: seconds under emulation, so only when it is wanted)."""
        body = "document.body ? String(document.body.innerText).slice(0, %d) : ''" % (TEXT_CAP + 1)
        v, _ = self.js("""(() => { const n = performance.getEntriesByType('navigation')[0];
            return {url: location.href, title: document.title,
                    status: n && n.responseStatus ? n.responseStatus : null,
                    text: %s}; })()""" % (body if text else "''"))
        v = v or {}
        out = {"url": v.get("url", ""), "title": v.get("title", ""), "status": v.get("status")}
        if text:
            t = v.get("text") or ""
            out["text"] = t[:TEXT_CAP]
            out["truncated"] = len(t) > TEXT_CAP
        return out

    def element(self, selector):
        """The element's centre in CSS pixels, scrolled into view; exit 3 when none matches."""
        v, err = self.js("(() => { const e = document.querySelector(%s); if (!e) return null;"
                         " e.scrollIntoView({block: 'center', inline: 'center'});"
                         " const r = e.getBoundingClientRect();"
                         " return [r.x + r.width / 2, r.y + r.height / 2]; })()" % json.dumps(selector))
        if err:
            fail(4, f"selector {selector!r}: {err}")
        if v is None:
            fail(3, f"no element matches {selector!r} on {self.state(False)['url']}")
        return v


def act():
    try:
        p = Page()
    except (OSError, ValueError, KeyError) as e:
        fail(1, f"the browser's DevTools endpoint: {e} (its log: {LOG})")
    if action == "open":
        r = p.call("Page.navigate", url=req["url"])
        if r.get("errorText"):
            why = r["errorText"]
            if why == "net::ERR_TUNNEL_CONNECTION_FAILED":
                why += proxy_said(req["url"])
            out = {"url": req["url"], "title": "", "status": None, "error": why, "text": ""}
            answer(out)
            sys.exit(0)
        loaded = p.settle()
        out = p.state()
        if not loaded:
            out["error"] = "the page was still loading when the action's time was up (its loading stopped)"
        answer(out)
    elif action == "read":
        answer(p.state())
    elif action == "click":
        x, y = p.element(req["selector"])
        p.call("Page.enable")
        for kind in ("mousePressed", "mouseReleased"):
            p.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        # a click that navigates (a link, a form) starts loading at once: then wait for the page
        if p.event({"Page.frameRequestedNavigation", "Page.frameStartedLoading", "Page.frameNavigated"}, 2):
            p.event({"Page.loadEventFired"}, max(0.5, left() - 3))
            p.settle()
        answer(p.state(False))
    elif action == "fill":
        sel = json.dumps(req["selector"])
        p.element(req["selector"])
        _, err = p.js("(() => { const e = document.querySelector(%s); e.focus();"
                      " if (typeof e.select === 'function') e.select();"
                      " else document.execCommand('selectAll'); })()" % sel)
        if err:
            fail(4, f"selector {req['selector']!r}: {err}")
        if req.get("text"):
            p.call("Input.insertText", text=req["text"])
        else:
            p.call("Input.dispatchKeyEvent", type="keyDown", key="Delete", code="Delete",
                   windowsVirtualKeyCode=46)
            p.call("Input.dispatchKeyEvent", type="keyUp", key="Delete", code="Delete",
                   windowsVirtualKeyCode=46)
        v, _ = p.js("(() => { const e = document.querySelector(%s); return e && 'value' in e ? e.value : (e ? e.textContent : null); })()" % sel)
        out = p.state(False)
        out["value"] = v
        answer(out)
    elif action == "evaluate":
        v, err = p.js(req["expression"], page_world=True)
        out = p.state(False)
        if err:
            out["error"] = err
        else:
            out["value"] = v
        answer(out)
    elif action == "screenshot":
        r = p.call("Page.captureScreenshot", format="png")
        out = p.state(False)
        out["png"] = r.get("data", "")
        answer(out)
    else:
        fail(4, f"no action {action!r}")


try:
    act()
except (OSError, ValueError, KeyError, TypeError) as e:
    fail(1, f"the browser: {type(e).__name__}: {e} (its log: {LOG})")
EOS
chmod 0755 "$D/drive"
cat > "$D/relay" <<'EOS'
#!/usr/bin/python3
"""relay PORTFILE [PORT]: the agent's browser's way to the egress proxy (the browser layer's
header). Listens on 127.0.0.1 (PORT, else one the kernel picks, written with its pid to
PORTFILE); for each connection it reads the request's head, adds the proxy's credentials when
the proxy has them (libvirt's shared proxy takes the VM's token as its password, which
Chromium cannot send from --proxy-server), asks for the connection to close after one request
(the proxy checks every request, and only the first has the credentials added), and carries
the rest both ways. The proxy is read from /run/boxery/env again whenever that file changes,
so a new egress proxy or token applies to the next connection without restarting the browser.
A proxy that refuses the credentials (407) is answered 502, never a login prompt; a refused
tunnel is closed."""
import base64, os, shlex, socket, sys, threading
from urllib.parse import unquote, urlsplit

ENV = "/run/boxery/env"
HOP = (b"proxy-authorization", b"proxy-connection", b"connection", b"keep-alive")
HEAD_MAX = 64 * 1024
# connections at once; more are closed at once
SLOTS = threading.BoundedSemaphore(256)
seen = {"key": None, "proxy": None}
seen_lock = threading.Lock()


def read_env():
    """(host, port, Basic credentials or None) of the egress proxy in ENV; None without one
    (or when it cannot be read as the control plane writes it)."""
    try:
        with open(ENV) as f:
            text = f.read()
        for line in text.splitlines():
            if "http_proxy=" not in line:
                continue
            for word in shlex.split(line, comments=True):
                if word.startswith("http_proxy="):
                    u = urlsplit(word[len("http_proxy="):])
                    cred = None
                    if u.password is not None:
                        pair = f"{unquote(u.username or '')}:{unquote(u.password)}"
                        cred = base64.b64encode(pair.encode())
                    if u.hostname:
                        return (u.hostname, u.port or 80, cred)
    except (OSError, ValueError) as e:
        print(f"relay: {ENV}: {e}", file=sys.stderr, flush=True)
    return None


def proxy():
    """The egress proxy now (ENV read again when it changed)."""
    try:
        st = os.stat(ENV)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        return None
    with seen_lock:
        if key != seen["key"]:
            seen["key"], seen["proxy"] = key, read_env()
        return seen["proxy"]


def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def head_of(s):
    """A message's head (up to its blank line) and what came after it; None when the peer
    closed first or sent more than HEAD_MAX."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        if not more or len(data) > HEAD_MAX:
            return None
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def serve(c):
    up = None
    try:
        c.settimeout(30)  # a request's head comes at once, or not at all
        got = head_of(c)
        if got is None:
            return
        c.settimeout(None)
        head, rest = got
        lines = head.split(b"\r\n")
        p = proxy()
        if p is None:
            c.sendall(b"HTTP/1.1 502 No egress proxy in /run/boxery/env\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        tunnel = lines[0].upper().startswith(b"CONNECT ")
        kept = [l for l in lines[1:] if l.split(b":", 1)[0].strip().lower() not in HOP]
        if not tunnel:
            kept.append(b"Connection: close")
        if p[2]:
            kept.append(b"Proxy-Authorization: Basic " + p[2])
        up = socket.create_connection((p[0], p[1]), timeout=30)
        up.settimeout(None)
        up.sendall(b"\r\n".join([lines[0]] + kept) + b"\r\n\r\n" + rest)
        # a request's body goes on while its answer is awaited; a tunnel's bytes only once
        # the proxy has opened it
        t = threading.Thread(target=pipe, args=(c, up), daemon=True)
        if not tunnel:
            t.start()
        got = head_of(up)
        if got is None:
            return
        answer, after = got
        status = (answer.split(b" ", 2)[1:2] or [b""])[0]
        if status == b"407":
            # the proxy refused the VM's token: no login prompt in the browser
            answer = b"HTTP/1.1 502 The egress proxy refused this VM's token\r\nContent-Length: 0\r\nConnection: close"
            after = b""
        c.sendall(answer + b"\r\n\r\n" + after)
        if status == b"407" or (tunnel and not status.startswith(b"2")):
            return  # a refused tunnel is closed
        if tunnel:
            t.start()
        pipe(up, c)
        t.join()
    except OSError:
        pass
    finally:
        for s in (c, up):
            if s is not None:
                s.close()
        SLOTS.release()


srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[2]) if len(sys.argv) > 2 else 0))
srv.listen(64)
tmp = sys.argv[1] + ".new"
with open(tmp, "w") as f:
    f.write(f"{srv.getsockname()[1]} {os.getpid()}\n")
os.replace(tmp, sys.argv[1])
while True:
    try:
        c, _ = srv.accept()
    except OSError as e:  # out of descriptors, for one: try again in a moment
        print(f"relay: accept: {e}", file=sys.stderr, flush=True)
        threading.Event().wait(0.1)
        continue
    if not SLOTS.acquire(blocking=False):
        c.close()
        continue
    try:
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    except RuntimeError:
        c.close()
        SLOTS.release()
EOS
chmod 0755 "$D/relay"
echo "browser: done ($(chromium --version 2>/dev/null || echo chromium))"
