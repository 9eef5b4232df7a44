#define _GNU_SOURCE
/* slirpd: libslirp outside QEMU, for one VM.
 *   slirpd NETSOCK HOSTFWD_PORT PROXY_SOCK
 * Listens on the unix stream socket NETSOCK for QEMU's `-netdev stream,server=off,addr.type=unix,addr.path=NETSOCK`
 * (frames: 4-byte big-endian length + ethernet frame). Restricted slirp 10.0.2.0/24 like QEMU's user netdev
 * (host 10.0.2.2, DHCP from 10.0.2.15, DNS 10.0.2.3), hostfwd tcp 127.0.0.1:HOSTFWD_PORT -> guest:22,
 * guest connections to 10.0.2.100:80 -> connect() to the unix socket PROXY_SOCK (slirp_add_unix; no process spawned).
 * When QEMU disconnects, waits for it to reconnect (slirp state kept). */
#include <slirp/libslirp.h>
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int qfd = -1, lfd = -1;
struct timer { SlirpTimerCb cb; void *opaque; int64_t expire_ms; int active; struct timer *next; };
static struct timer *timers;
static struct pollfd pfd[1024]; static int npfd;

static int64_t clock_ns(void *o) { (void)o; struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static ssize_t send_packet(const void *buf, size_t len, void *o) {
    (void)o; if (qfd < 0) return len;   /* no guest attached: drop, TCP retransmits */
    uint32_t be = htonl(len); struct iovec iov[2] = {{&be, 4}, {(void *)buf, len}};
    size_t want = 4 + len, done = 0;
    while (done < want) {           /* blocking socket: a frame is never split */
        ssize_t k = writev(qfd, iov, 2); if (k < 0) { if (errno == EINTR) continue; return -1; }
        done += k; for (int i = 0; i < 2 && k > 0; i++) { size_t d = (size_t)k < iov[i].iov_len ? (size_t)k : iov[i].iov_len; iov[i].iov_base = (char *)iov[i].iov_base + d; iov[i].iov_len -= d; k -= d; }
    }
    return len;
}
static void guest_error(const char *msg, void *o) { (void)o; fprintf(stderr, "slirpd: guest error: %s\n", msg); }
static void *timer_new(SlirpTimerCb cb, void *cbo, void *o) { (void)o; struct timer *t = calloc(1, sizeof *t); t->cb = cb; t->opaque = cbo; t->next = timers; timers = t; return t; }
static void timer_free(void *tp, void *o) { (void)o; for (struct timer **p = &timers; *p; p = &(*p)->next) if (*p == tp) { *p = (*p)->next; free(tp); return; } }
static void timer_mod(void *tp, int64_t exp, void *o) { (void)o; struct timer *t = tp; t->expire_ms = exp; t->active = 1; }
static void reg_fd(int fd, void *o) { (void)fd; (void)o; }
static void notify(void *o) { (void)o; }
static int add_poll(int fd, int ev, void *o) {
    (void)o; short e = 0;
    if (ev & SLIRP_POLL_IN) e |= POLLIN; if (ev & SLIRP_POLL_OUT) e |= POLLOUT; if (ev & SLIRP_POLL_PRI) e |= POLLPRI;
    if (ev & SLIRP_POLL_ERR) e |= POLLERR; if (ev & SLIRP_POLL_HUP) e |= POLLHUP;
    pfd[npfd].fd = fd; pfd[npfd].events = e; pfd[npfd].revents = 0; return npfd++;
}
static int get_revents(int idx, void *o) {
    (void)o; short r = pfd[idx].revents; int ev = 0;
    if (r & POLLIN) ev |= SLIRP_POLL_IN; if (r & POLLOUT) ev |= SLIRP_POLL_OUT; if (r & POLLPRI) ev |= SLIRP_POLL_PRI;
    if (r & POLLERR) ev |= SLIRP_POLL_ERR; if (r & POLLHUP) ev |= SLIRP_POLL_HUP; return ev;
}
static const SlirpCb cbs = { .send_packet = send_packet, .guest_error = guest_error, .clock_get_ns = clock_ns,
    .timer_new = timer_new, .timer_free = timer_free, .timer_mod = timer_mod,
    .register_poll_fd = reg_fd, .unregister_poll_fd = reg_fd, .notify = notify };

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: slirpd NETSOCK HOSTFWD_PORT PROXY_SOCK\n"); return 2; }
    signal(SIGPIPE, SIG_IGN);
    SlirpConfig cfg = { .version = 4, .restricted = 1, .in_enabled = true, .in6_enabled = false };
    inet_pton(AF_INET, "10.0.2.0", &cfg.vnetwork); inet_pton(AF_INET, "255.255.255.0", &cfg.vnetmask);
    inet_pton(AF_INET, "10.0.2.2", &cfg.vhost); inet_pton(AF_INET, "10.0.2.15", &cfg.vdhcp_start);
    inet_pton(AF_INET, "10.0.2.3", &cfg.vnameserver);
    Slirp *s = slirp_new(&cfg, &cbs, NULL);
    if (!s) { fprintf(stderr, "slirp_new failed\n"); return 1; }
    struct in_addr lo, any = {0}, px; inet_pton(AF_INET, "127.0.0.1", &lo); inet_pton(AF_INET, "10.0.2.100", &px);
    if (slirp_add_hostfwd(s, 0, lo, atoi(argv[2]), any, 22) < 0) { perror("hostfwd"); return 1; }
    if (slirp_add_unix(s, argv[3], &px, 80) < 0) { fprintf(stderr, "slirp_add_unix failed\n"); return 1; }
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un ua = { .sun_family = AF_UNIX }; strncpy(ua.sun_path, argv[1], sizeof ua.sun_path - 1); unlink(argv[1]);
    if (bind(lfd, (void *)&ua, sizeof ua) || listen(lfd, 1)) { perror("netsock"); return 1; }
    fprintf(stderr, "slirpd: %s, listening on %s\n", slirp_version_string(), argv[1]);
    static uint8_t buf[4 + 65536 * 2]; size_t have = 0;
    for (;;) {
        npfd = 0;
        add_poll(qfd >= 0 ? qfd : lfd, SLIRP_POLL_IN, NULL);
        uint32_t timeout = 1000;                       /* ms; slirp lowers it */
        slirp_pollfds_fill(s, &timeout, add_poll, NULL);
        int64_t now = clock_ns(NULL) / 1000000;
        for (struct timer *t = timers; t; t = t->next) if (t->active) { int64_t d = t->expire_ms - now; if (d < 0) d = 0; if ((uint32_t)d < timeout) timeout = d; }
        int r = poll(pfd, npfd, timeout);
        if (pfd[0].revents) {
            if (qfd < 0) { qfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC); have = 0; fprintf(stderr, "slirpd: qemu connected\n"); }
            else {
                ssize_t k = read(qfd, buf + have, sizeof buf - have);
                if (k <= 0) { fprintf(stderr, "slirpd: qemu disconnected\n"); close(qfd); qfd = -1; }
                else {
                    have += k; size_t off = 0;
                    while (have - off >= 4) {
                        uint32_t len = ntohl(*(uint32_t *)(buf + off));
                        if (len > 65536) { fprintf(stderr, "bad frame len %u\n", len); close(qfd); qfd = -1; have = off = 0; break; }
                        if (have - off < 4 + len) break;
                        slirp_input(s, buf + off + 4, len); off += 4 + len;
                    }
                    memmove(buf, buf + off, have - off); have -= off;
                }
            }
        }
        slirp_pollfds_poll(s, r < 0, get_revents, NULL);
        now = clock_ns(NULL) / 1000000;
        for (struct timer *t = timers; t; t = t->next) if (t->active && t->expire_ms <= now) { t->active = 0; t->cb(t->opaque); }
    }
}
