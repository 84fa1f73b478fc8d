/* A stand-in for the CUDA runtime's few entry points that ext/pool_writer.cpp looks up
 * (tests/test_pool_writer_cuda.py builds it as libcudart.so.12 and loads it before the
 * native core), so that the CUDA write path runs on a machine without a GPU. Every
 * pointer is device memory of device 0; a copy is queued on its stream and done only when
 * the stream is synchronized, as a DMA may run any time until then; fake_fail_at(n) makes
 * the n-th cudaMemcpyAsync from now fail. fake_pending() counts queued copies,
 * fake_copies() every cudaMemcpyAsync so far, fake_sync_delay_us(n) makes each stream
 * synchronisation take n microseconds more (a transfer's time). An event is passed once
 * cudaEventQuery has answered cudaErrorNotReady fake_event_delay(n) times since it was
 * recorded, or at once after fake_events_ready(); then its stream's queued copies are
 * done. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct attrs { int type, device; void *dptr, *hptr; };
struct copy { void* dst; const void* src; size_t n; int stream; struct copy* next; };

static struct copy* queued;
struct event { int stream, not_ready; };
static int streams, fail_at, calls, copies, sync_delay_us, event_delay, events_ready;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

int cudaPointerGetAttributes(struct attrs* a, const void* p) {
  a->type = 2;
  a->device = 0;
  a->dptr = a->hptr = (void*)p;
  return 0;
}
int cudaSetDevice(int d) { return d == 0 ? 0 : 101; }
int cudaStreamCreateWithFlags(void** s, unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  *s = (void*)(long)++streams;
  pthread_mutex_unlock(&mu);
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* s) {
  (void)kind;
  pthread_mutex_lock(&mu);
  ++copies;
  const int fail = fail_at > 0 && ++calls == fail_at;
  if (!fail) {
    struct copy* c = malloc(sizeof *c);
    *c = (struct copy){dst, src, n, (int)(long)s, queued};
    queued = c;
  }
  pthread_mutex_unlock(&mu);
  return fail ? 1 : 0; /* 1: cudaErrorInvalidValue */
}
int cudaMemsetAsync(void* dst, int v, size_t n, void* s) {
  (void)s;
  memset(dst, v, n);
  return 0;
}
/* Under mu: makes the copies queued on stream s. */
static void drain(int s) {
  for (struct copy** p = &queued; *p;) {
    struct copy* c = *p;
    if (c->stream != s) {
      p = &c->next;
      continue;
    }
    memcpy(c->dst, c->src, c->n);
    *p = c->next;
    free(c);
  }
}
int cudaStreamSynchronize(void* s) {
  if (sync_delay_us > 0) usleep((useconds_t)sync_delay_us);
  pthread_mutex_lock(&mu);
  drain((int)(long)s);
  pthread_mutex_unlock(&mu);
  return 0;
}
int cudaStreamQuery(void* s) {
  pthread_mutex_lock(&mu);
  drain((int)(long)s);
  pthread_mutex_unlock(&mu);
  return 0;
}
int cudaEventCreateWithFlags(void** e, unsigned flags) {
  (void)flags;
  *e = calloc(1, sizeof(struct event));
  return *e ? 0 : 2; /* 2: cudaErrorMemoryAllocation */
}
int cudaEventRecord(void* e, void* s) {
  pthread_mutex_lock(&mu);
  *(struct event*)e = (struct event){(int)(long)s, event_delay};
  pthread_mutex_unlock(&mu);
  return 0;
}
int cudaEventQuery(void* e) {
  struct event* ev = e;
  pthread_mutex_lock(&mu);
  const int ready = events_ready || ev->not_ready-- <= 0;
  if (ready) drain(ev->stream);
  pthread_mutex_unlock(&mu);
  return ready ? 0 : 600; /* 600: cudaErrorNotReady */
}
int cudaEventDestroy(void* e) {
  free(e);
  return 0;
}
int cudaHostRegister(void* p, size_t n, unsigned f) { (void)p, (void)n, (void)f; return 0; }
int cudaHostUnregister(void* p) { (void)p; return 0; }
int cudaHostGetDevicePointer(void** d, void* p, unsigned f) { (void)f; *d = p; return 0; }
const char* cudaGetErrorString(int e) { return e == 1 ? "invalid argument" : "error"; }

void fake_fail_at(int n) {
  pthread_mutex_lock(&mu);
  fail_at = n, calls = 0;
  pthread_mutex_unlock(&mu);
}
int fake_pending(void) {
  int n = 0;
  pthread_mutex_lock(&mu);
  for (struct copy* c = queued; c; c = c->next) ++n;
  pthread_mutex_unlock(&mu);
  return n;
}
int fake_copies(void) {
  pthread_mutex_lock(&mu);
  const int n = copies;
  pthread_mutex_unlock(&mu);
  return n;
}
void fake_sync_delay_us(int n) { sync_delay_us = n; }
void fake_event_delay(int n) { event_delay = n; }
void fake_events_ready(void) {
  pthread_mutex_lock(&mu);
  events_ready = 1;
  pthread_mutex_unlock(&mu);
}
