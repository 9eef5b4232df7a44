#!/bin/bash
# desktop layer (root, idempotent): a virtual X display :0 for the agent user, driven by
# programs (xdotool) and read as a file, with a small window manager. Debian 12 packages only.
#   boxery-desktop.service     Xvfb :0 as `agent`, started at boot, Restart=always; the screen is
#                              BOXERY_DISPLAY=WIDTHxHEIGHT from /etc/boxery/desktop.env (optional,
#                              default 1280x800), depth 24; with -fbdir the framebuffer is the XWD
#                              file /run/boxery-desktop/Xvfb_screen0 (a screenshot is `cat`), its
#                              size marked beside it (size-WIDTHxHEIGHT)
#   boxery-desktop-wm.service  jwm on :0 as `agent`, bound to the display (restarted with it, and
#                              on its own when it dies); config /usr/local/lib/boxery/desktop/jwmrc
#   xterm, xdotool, x11-utils (xwininfo, xprop, xdpyinfo), python3-tk, fonts-dejavu-core, xauth
#   (xvfb-run needs it), and x11vnc installed but not started (`boxery desktop` starts it on demand,
#   on the guest's loopback)
# Who may use the display: the agent user, through a cookie. At each start Xvfb gets a new
# MIT-MAGIC-COOKIE-1 (its -auth file /run/boxery-desktop/auth, 0600), and the same cookie goes into
# ~agent/.Xauthority as a wildcard entry (any host name: cloud-init renames the guest after boot)
# for display 0, entries for other displays kept. ~/.Xauthority is where X clients look when
# XAUTHORITY is unset, so `DISPLAY=:0 cmd` works as agent in every kind of session (login shell,
# tmux, a non-login `ssh VM 'cmd'`, cron) with no environment to carry; other local users (system
# services, a container given the socket, anything reaching Linux's abstract socket
# @/tmp/.X11-unix/X0) are refused. The server listens on its unix sockets only (-nolisten tcp:
# never TCP). Login shells get DISPLAY=:0 when it is unset (profile.d), so a program
# an agent starts shows on the desktop; non-login ssh commands pass DISPLAY=:0 themselves.
# Why jwm and not openbox: both decorate and manage Tk windows and speak EWMH (xdotool
# windowactivate), but Debian's openbox pulls libimlib2 and with it ghostscript, x265, aom, urw
# fonts (about 110 MiB installed); jwm (click to focus, no tray) adds about 30 MiB.
# Not added to a running VM (packages and services): make the VM with it.
# `desktop.sh --print-packages` prints the packages.
set -euo pipefail
PACKAGES="xvfb xauth jwm xterm xdotool x11-utils python3-tk fonts-dejavu-core x11vnc"
[ "${1:-}" = --print-packages ] && { echo $PACKAGES; exit 0; }
[ "$(id -u)" = 0 ] || { echo "desktop: run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
. "$(dirname "$0")/lib.sh"
install_missing desktop $PACKAGES
id agent >/dev/null 2>&1 || { echo "desktop: no user agent (the plumbing layer makes it)" >&2; exit 1; }
D=/usr/local/lib/boxery/desktop
install -d -m 0755 "$D"

# --- the display: Xvfb on :0 -------------------------------------------------------------------
cat > "$D/xvfb" <<'EOS'
#!/bin/bash
# Run by boxery-desktop.service as agent: Xvfb :0 with a new cookie (the desktop layer's header).
# `xvfb --wait`: wait until :0 answers, 120 s at most (the unit's ExecStartPost: the WM unit,
# ordered after it, starts once the display is up). Xvfb is up in about 1 s on an idle TCG
# guest, but took 16 s while the guest was booting: a short limit would kill it in a loop.
set -euo pipefail
RUN=/run/boxery-desktop DEFAULT=1280x800
if [ "${1:-}" = --wait ]; then
  while [ "$SECONDS" -lt 120 ]; do
    XAUTHORITY=$RUN/auth xdpyinfo -display :0 >/dev/null 2>&1 && exit 0
    sleep 0.1
  done
  echo "boxery-desktop: display :0 not up after 120 s" >&2; exit 1
fi
size=${BOXERY_DISPLAY:-$DEFAULT}
if ! [[ $size =~ ^([1-9][0-9]{2,3})x([1-9][0-9]{2,3})$ ]] || [ "${BASH_REMATCH[1]}" -gt 7680 ] ||
   [ "${BASH_REMATCH[2]}" -gt 4320 ]; then
  echo "boxery-desktop: BOXERY_DISPLAY='$size' is not WIDTHxHEIGHT (100..7680 x 100..4320): using $DEFAULT" >&2
  size=$DEFAULT
fi
# the cookie: the server's file, and a wildcard entry for display 0 in ~/.Xauthority (kept: the
# entries for other displays, e.g. ssh -X's)
python3 - "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" "$RUN/auth" "$HOME/.Xauthority" <<'EOP'
import os, struct, sys
cookie, server, client = sys.argv[1:4]
def entry(family, fields):
    return struct.pack(">H", family) + b"".join(struct.pack(">H", len(f)) + f for f in fields)
wild = entry(0xFFFF, [b"", b"0", b"MIT-MAGIC-COOKIE-1", bytes.fromhex(cookie)])
def write(path, data):
    tmp = path + ".boxery-new"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.rename(tmp, path)
keep = b""
try:
    raw = open(client, "rb").read()
    i = 0
    while i + 2 <= len(raw):
        start, i, fields = i, i + 2, []
        for _ in range(4):
            (n,) = struct.unpack(">H", raw[i:i + 2])
            fields.append(raw[i + 2:i + 2 + n])
            i += 2 + n
        if i > len(raw):
            break
        if fields[1] != b"0":
            keep += raw[start:i]
except (OSError, struct.error):
    pass
write(server, wild)
write(client, wild + keep)
EOP
# the size the display starts at, marked beside its framebuffer: an action of computer use checks
# the screen is still the size of the last screenshot with a test of the shell, no process
rm -f -- "$RUN"/size-*
: > "$RUN/size-$size"
# -s 0: no screen saver (it would blank the framebuffer after 10 minutes)
exec /usr/bin/Xvfb :0 -screen 0 "${size}x24" -fbdir "$RUN" -auth "$RUN/auth" -nolisten tcp -s 0
EOS
chmod 0755 "$D/xvfb"

# --- typing any text exactly ------------------------------------------------------------------
# `type TEXT` (as agent, DISPLAY=:0): types TEXT on the display exactly, any Unicode. xdotool's own
# way with a character the keyboard map lacks (é, ✓, 日) is to rebind a spare key for it and
# change it back at once, and Tk reads the map too late: characters are dropped or swapped (0 of
# 3 exact at xdotool's default delay, measured). Here the missing characters are bound to spare
# keycodes first and left bound (the spare ones are recorded at the first use in this display's
# run directory, so they are reused, never a real key), then xdotool types text whose every
# character has a key. Text needing more characters than there are spare keycodes is typed in
# runs. Used by boxery's computer-use `type` (verbs/src/guest/computer).
cat > "$D/type" <<'EOS'
#!/usr/bin/python3
"""type TEXT: type TEXT exactly on display :0 (the desktop layer's header says how)."""
import ctypes, ctypes.util, os, subprocess, sys, time

text = sys.argv[1]
POOL = "/run/boxery-desktop/typing-keycodes"
x = ctypes.cdll.LoadLibrary(ctypes.util.find_library("X11") or "libX11.so.6")
x.XOpenDisplay.restype = ctypes.c_void_p
x.XOpenDisplay.argtypes = [ctypes.c_char_p]
x.XGetKeyboardMapping.restype = ctypes.POINTER(ctypes.c_ulong)
x.XGetKeyboardMapping.argtypes = [ctypes.c_void_p, ctypes.c_ubyte, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_int)]
x.XChangeKeyboardMapping.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_ulong), ctypes.c_int]
x.XDisplayKeycodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                               ctypes.POINTER(ctypes.c_int)]
x.XSync.argtypes = [ctypes.c_void_p, ctypes.c_int]
x.XFree.argtypes = [ctypes.c_void_p]
d = x.XOpenDisplay(None)
if not d:
    sys.exit("cannot open display :0 (is boxery-desktop.service running?)")
lo, hi = ctypes.c_int(), ctypes.c_int()
x.XDisplayKeycodes(d, ctypes.byref(lo), ctypes.byref(hi))


def mapping():
    """{keycode: [keysyms]} of the whole keyboard."""
    per = ctypes.c_int()
    n = hi.value - lo.value + 1
    m = x.XGetKeyboardMapping(d, lo.value, n, ctypes.byref(per))
    out = {lo.value + i: [m[i * per.value + j] for j in range(per.value)] for i in range(n)}
    x.XFree(m)
    return out


def keysym(c):
    o = ord(c)
    return o if 0x20 <= o <= 0x7E or 0xA0 <= o <= 0xFF else 0x01000000 + o


keys = mapping()
try:
    pool = [int(k) for k in open(POOL).read().split()]
except OSError:
    pool = [k for k, syms in keys.items() if not any(syms)]
    with open(POOL + ".new", "w") as f:
        f.write(" ".join(map(str, pool)))
    os.replace(POOL + ".new", POOL)
# keysyms on real keys, and what each pool keycode holds now
real = {s for k, syms in keys.items() if k not in pool for s in syms if s}
held = {keys[k][0]: k for k in pool if keys[k][0]}


def typed(run):
    subprocess.run(["xdotool", "type", "--delay", "12", "--", run], check=True)


run, bound = "", set()
for c in text:
    ks = keysym(c) if c not in "\n\t" else 0
    if ks and ks not in real and ks not in held:
        if not pool:
            sys.exit("the keyboard has no spare keycode to type %r with" % c)
        free = [k for k in pool if keys[k][0] not in bound]
        if not free:  # every spare key is needed by this run: type it, then rebind
            typed(run)
            time.sleep(0.2)
            run, bound = "", set()
            free = pool
        k = free[0]
        old = keys[k][0]
        held.pop(old, None)
        syms = (ctypes.c_ulong * 2)(ks, ks)
        x.XChangeKeyboardMapping(d, k, 2, syms, 1)
        x.XSync(d, 0)
        keys[k] = [ks, ks]
        held[ks] = k
        time.sleep(0.05)  # let clients read the new map before its first use
    if ks in held:
        bound.add(ks)
    run += c
if run:
    typed(run)
EOS
chmod 0755 "$D/type"

# StartLimitIntervalSec=0: never give up restarting. After=cloud-init.service (named
# cloud-init-network.service from cloud-init 24.3): a new VM's seed writes /etc/boxery/desktop.env
# (spec.display) there, so the first start has its size (no start at
# the default and another when the control plane pushes the size). RuntimeDirectoryMode 0750 and
# UMask 0027: the screen (Xvfb_screen0) and the cookie are the agent user's only.
cat > /etc/systemd/system/boxery-desktop.service <<'EOS'
[Unit]
Description=boxery desktop: virtual X display :0 (Xvfb), framebuffer /run/boxery-desktop/Xvfb_screen0
After=cloud-init.service cloud-init-network.service
StartLimitIntervalSec=0

[Service]
User=agent
Group=agent
Environment=BOXERY_DISPLAY=1280x800
EnvironmentFile=-/etc/boxery/desktop.env
RuntimeDirectory=boxery-desktop
RuntimeDirectoryMode=0750
UMask=0027
ExecStart=/usr/local/lib/boxery/desktop/xvfb
ExecStartPost=/usr/local/lib/boxery/desktop/xvfb --wait
TimeoutStartSec=150
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
EOS

# --- the window manager ------------------------------------------------------------------------
# BindsTo: stopped with the display, and restarted with it (systemd restarts a service's bound
# units when it restarts it); Restart=always: restarted when it dies on its own
cat > /etc/systemd/system/boxery-desktop-wm.service <<'EOS'
[Unit]
Description=boxery desktop: window manager (jwm) on :0
BindsTo=boxery-desktop.service
After=boxery-desktop.service
StartLimitIntervalSec=0

[Service]
User=agent
Group=agent
Environment=DISPLAY=:0 XAUTHORITY=/run/boxery-desktop/auth
WorkingDirectory=~
ExecStart=/usr/bin/jwm -f /usr/local/lib/boxery/desktop/jwmrc
Restart=always
RestartSec=1

[Install]
WantedBy=boxery-desktop.service
EOS

# click to focus and raise; title bars with close/maximize/minimize; no tray, one desktop; new
# windows cascade from the top left
cat > "$D/jwmrc" <<'EOS'
<?xml version="1.0"?>
<JWM>
    <RootMenu onroot="123">
        <Program label="Terminal">xterm</Program>
        <Separator/>
        <Restart label="Restart the window manager"/>
    </RootMenu>
    <WindowStyle>
        <Font>DejaVu Sans-10:bold</Font>
        <Width>4</Width>
        <Height>24</Height>
        <Corner>0</Corner>
        <Foreground>#000000</Foreground>
        <Background>#c0c0c0</Background>
        <Outline>#606060</Outline>
        <Active>
            <Foreground>#ffffff</Foreground>
            <Background>#2a5d9f</Background>
            <Outline>#000000</Outline>
        </Active>
    </WindowStyle>
    <MenuStyle>
        <Font>DejaVu Sans-10</Font>
        <Foreground>#000000</Foreground>
        <Background>#e0e0e0</Background>
        <Active>
            <Foreground>#ffffff</Foreground>
            <Background>#2a5d9f</Background>
        </Active>
    </MenuStyle>
    <PopupStyle>
        <Font>DejaVu Sans-10</Font>
        <Foreground>#000000</Foreground>
        <Background>#ffffe0</Background>
    </PopupStyle>
    <Desktops width="1" height="1">
        <Background type="solid">#2e3440</Background>
    </Desktops>
    <FocusModel>click</FocusModel>
    <SnapMode distance="10">border</SnapMode>
    <MoveMode>opaque</MoveMode>
    <ResizeMode>opaque</ResizeMode>
    <DoubleClickSpeed>400</DoubleClickSpeed>
    <DoubleClickDelta>2</DoubleClickDelta>
    <Key key="Up">up</Key>
    <Key key="Down">down</Key>
    <Key key="Right">right</Key>
    <Key key="Left">left</Key>
    <Key key="Return">select</Key>
    <Key key="Escape">escape</Key>
    <Key mask="A" key="Tab">nextstacked</Key>
    <Key mask="A" key="F4">close</Key>
    <Key mask="A" key="F10">maximize</Key>
    <Mouse context="title" button="1">move</Mouse>
    <Mouse context="title" button="3">window</Mouse>
    <Mouse context="title" button="11">maximize</Mouse>
    <Mouse context="border" button="1">resize</Mouse>
    <Mouse context="border" button="3">window</Mouse>
    <Mouse context="close" button="-1">close</Mouse>
    <Mouse context="maximize" button="-1">maximize</Mouse>
    <Mouse context="minimize" button="-1">minimize</Mouse>
    <Mouse context="icon" button="1">window</Mouse>
</JWM>
EOS
chmod 0644 "$D/jwmrc"

# --- started at boot (the build runs in a chroot without systemd: the links `systemctl enable`
# would make) -----------------------------------------------------------------------------------
mkdir -p /etc/systemd/system/multi-user.target.wants /etc/systemd/system/boxery-desktop.service.wants
ln -sf /etc/systemd/system/boxery-desktop.service /etc/systemd/system/multi-user.target.wants/boxery-desktop.service
ln -sf /etc/systemd/system/boxery-desktop-wm.service /etc/systemd/system/boxery-desktop.service.wants/boxery-desktop-wm.service

# --- the agent's sessions ----------------------------------------------------------------------
cat > /etc/profile.d/boxery-desktop.sh <<'EOS'
# boxery desktop: programs started from a login shell show on the virtual display :0 (the cookie
# is ~/.Xauthority, written when the display starts)
[ -n "${DISPLAY:-}" ] || export DISPLAY=:0
EOS
# xterm with an outline font (Unicode) instead of the server's built-in bitmap `fixed`; Xt reads
# ~/.Xdefaults when no resources are loaded on the server (nothing runs xrdb here)
if [ ! -e /home/agent/.Xdefaults ]; then
  printf 'XTerm*faceName: DejaVu Sans Mono\nXTerm*faceSize: 11\n' > /home/agent/.Xdefaults
  chown agent:agent /home/agent/.Xdefaults
fi
# jwm depends on "rxvt-unicode | … | x-terminal-emulator" and debootstrap takes the first
# alternative: xterm is the terminal here, so rxvt-unicode goes (apt lets it: xterm provides
# x-terminal-emulator)
if [ "$(dpkg-query -W -f='${db:Status-Abbrev}' rxvt-unicode 2>/dev/null | cut -c1-2)" = ii ] &&
   [ "$(dpkg-query -W -f='${db:Status-Abbrev}' xterm 2>/dev/null | cut -c1-2)" = ii ]; then
  apt-get purge -y -q rxvt-unicode >/dev/null
fi
echo "desktop: done ($(dpkg-query -W -f='xvfb ${Version}, ' xvfb)$(dpkg-query -W -f='jwm ${Version}' jwm))"
