/* An open-loop HTTP/1.1 load generator for the gateway benchmarks (bench/loadgen.py builds it with the system C
 * compiler and calls lg_run through ctypes, which releases the GIL): each request is sent at its scheduled time
 * on an idle keep-alive connection (a new one when none is idle), and its latency counts from that scheduled
 * time (no coordinated omission). One thread and epoll; a few microseconds of CPU a request, where
 * the asyncio client it replaces spent ~0.15 ms, as much as the server under test on a 2-core machine.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { LG_OK = 0, LG_TIMEOUT = 1, LG_CLOSED = 2, LG_BAD = 3, LG_PENDING = -1 };

typedef struct {
    int fd;
    int64_t req;       /* the request it carries, -1 when idle */
    int64_t sent;      /* payload bytes written so far */
    char *buf;         /* the response so far */
    int64_t len, cap;
} Conn;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char *find(const char *hay, int64_t n, const char *needle, int64_t m) {
    return m <= n ? memmem(hay, n, needle, m) : NULL;
}

/* The value of the content-length header in the lower-cased head low[0, n), read no further than n (the head
 * is not NUL-terminated: strtoll on it once read on into stale stack bytes, so a last header "content-length: 15"
 * followed by a leftover digit waited for a body that never came, every request of a run timing out);
 * -1 where there is none or it is not a number. */
int64_t lg_content_length(const char *low, int64_t n) {
    const char *cl = find(low, n, "content-length:", 15);
    if (!cl) return -1;
    const char *p = cl + 15, *end = low + n;
    while (p < end && (*p == ' ' || *p == '\t')) p++;
    if (p == end || *p < '0' || *p > '9') return -1;
    int64_t v = 0;
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        v = v * 10 + (*p - '0');
        if (v > ((int64_t)1 << 40)) return -1;
    }
    return v;
}

/* 1: a whole response is in buf (chunked, or with a content-length); 0: not yet; -1: not HTTP we can read */
static int complete(const Conn *c) {
    const char *end = find(c->buf, c->len, "\r\n\r\n", 4);
    if (!end) return 0;
    int64_t head = end - c->buf;
    char low[8192];
    if (head >= (int64_t)sizeof(low)) return -1;
    for (int64_t i = 0; i < head; i++) low[i] = (c->buf[i] >= 'A' && c->buf[i] <= 'Z') ? c->buf[i] + 32 : c->buf[i];
    if (find(low, head, "transfer-encoding: chunked", 26))
        return c->len >= head + 9 && memcmp(c->buf + c->len - 7, "\r\n0\r\n\r\n", 7) == 0;
    int64_t body = lg_content_length(low, head);
    if (body < 0) return -1;
    return c->len >= head + 4 + body;
}

static int open_conn(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Send requests at t0 + arrivals[i] (seconds, ascending) to 127.0.0.1:port, each `payload`; a response is good
 * when it starts "HTTP/1.1 200" and holds `marker`. Per request: latency[i] seconds from its scheduled time to
 * its response's last byte, lag[i] how late it was sent, status[i] LG_OK / LG_TIMEOUT (none within timeout_s) /
 * LG_CLOSED (connect failed or the server closed) / LG_BAD. Returns the connections opened, or -1. */
int64_t lg_run(int port, const char *payload, int64_t payload_len, const double *arrivals, int64_t n,
               double timeout_s, const char *marker, int64_t marker_len, double *latency, double *lag,
               int *status, int64_t max_conns) {
    Conn *conns = calloc(max_conns, sizeof(Conn));
    int64_t *idle = malloc(max_conns * sizeof(int64_t));
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (!conns || !idle || ep < 0) return -1;
    int64_t nconns = 0, nidle = 0, next = 0, pending = 0;
    for (int64_t i = 0; i < n; i++) status[i] = LG_PENDING;
    const double t0 = now_s();

    /* end the request on connection k with `st`; a good connection goes back to the idle stack */
    #define FINISH(k, st, keep)                                                                               \
        do {                                                                                                  \
            Conn *c_ = &conns[k];                                                                             \
            latency[c_->req] = now_s() - t0 - arrivals[c_->req];                                              \
            status[c_->req] = (st);                                                                           \
            c_->req = -1;                                                                                     \
            c_->len = 0;                                                                                      \
            pending--;                                                                                        \
            if (keep) idle[nidle++] = (k);                                                                    \
            else { close(c_->fd); c_->fd = -1; }                                                              \
        } while (0)

    while (next < n || pending > 0) {
        double t = now_s() - t0;
        while (next < n && arrivals[next] <= t) { /* send what is due */
            int64_t k = -1;
            while (nidle > 0 && k < 0) {
                k = idle[--nidle];
                if (conns[k].fd < 0) k = -1;
            }
            if (k < 0) {
                for (k = 0; k < nconns && conns[k].fd >= 0; k++) {}
                if (k == max_conns) { status[next] = LG_CLOSED; latency[next] = 0; lag[next] = 0; next++; continue; }
                if (k == nconns) nconns++;
                conns[k].fd = open_conn(port);
                conns[k].req = -1;
                if (conns[k].fd < 0) { status[next] = LG_CLOSED; latency[next] = 0; lag[next] = 0; next++; continue; }
                struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = (uint64_t)k};
                epoll_ctl(ep, EPOLL_CTL_ADD, conns[k].fd, &e);
            }
            Conn *c = &conns[k];
            c->req = next;
            c->sent = 0;
            c->len = 0;
            lag[next] = t - arrivals[next];
            pending++;
            next++;
            ssize_t w = send(c->fd, payload, payload_len, MSG_NOSIGNAL);
            if (w > 0) c->sent = w;
            else if (w < 0 && errno != EAGAIN && errno != ENOTCONN) FINISH(k, LG_CLOSED, 0);
            if (c->fd >= 0 && c->req >= 0 && c->sent < payload_len) {
                struct epoll_event e = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP, .data.u64 = (uint64_t)k};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
            }
            t = now_s() - t0;
        }
        /* the first deadline: the next arrival or the oldest request's timeout */
        double wake = next < n ? arrivals[next] : t + 0.05;
        for (int64_t k = 0; k < nconns; k++) {
            if (conns[k].fd < 0 || conns[k].req < 0) continue;
            double dead = arrivals[conns[k].req] + timeout_s;
            if (dead <= t) FINISH(k, LG_TIMEOUT, 0);
            else if (dead < wake) wake = dead;
        }
        double wait = wake - (now_s() - t0);
        if (wait < 0) wait = 0;
        struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (double)(time_t)wait) * 1e9)};
        struct epoll_event events[64];
        int got = epoll_pwait2(ep, events, 64, &ts, NULL); /* nanosecond timeout (Linux 5.11) */
        for (int e = 0; e < got; e++) {
            int64_t k = (int64_t)events[e].data.u64;
            Conn *c = &conns[k];
            if (c->fd < 0) continue;
            if ((events[e].events & EPOLLOUT) && c->req >= 0 && c->sent < payload_len) {
                ssize_t w = send(c->fd, payload + c->sent, payload_len - c->sent, MSG_NOSIGNAL);
                if (w > 0) c->sent += w;
                else if (w < 0 && errno != EAGAIN) { FINISH(k, LG_CLOSED, 0); continue; }
                if (c->sent == payload_len) {
                    struct epoll_event m = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = (uint64_t)k};
                    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &m);
                }
            }
            if (!(events[e].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) continue;
            for (;;) {
                if (c->cap - c->len < 65536) {
                    c->cap = c->cap ? 2 * c->cap : 131072;
                    c->buf = realloc(c->buf, c->cap);
                }
                ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
                if (r > 0) {
                    c->len += r;
                    if (c->len < c->cap) break; /* all there was (epoll says again if more comes) */
                    continue;
                }
                if (r < 0 && errno == EAGAIN) break;
                /* closed or failed: a request in flight ends with it */
                if (c->req >= 0) FINISH(k, LG_CLOSED, 0);
                else { close(c->fd); c->fd = -1; }
                break;
            }
            if (c->fd < 0 || c->req < 0 || c->len == 0) continue;
            int done = complete(c);
            if (done == 0) continue;
            int good = done > 0 && c->len >= 12 && memcmp(c->buf, "HTTP/1.1 200", 12) == 0 &&
                       find(c->buf, c->len, marker, marker_len) != NULL;
            FINISH(k, good ? LG_OK : LG_BAD, done > 0);
        }
    }
    for (int64_t k = 0; k < nconns; k++) {
        if (conns[k].fd >= 0) close(conns[k].fd);
        free(conns[k].buf);
    }
    close(ep);
    free(conns);
    free(idle);
    return nconns;
}
