// Record reads on the reader threads (ext/reader_pool.h) as their callers wait for them:
// ExpertCache's demand reads and prefetch fills, and LayerScratch's staging reads.
//
// Life of one record read. A read is Pending while queued or reading; its reader moves it
// to Copying only after the bytes and checksum are good, copies them where they go, then
// settles it Done; a failed read settles Failed. Whoever waits for it may instead settle
// a Pending read Abandoned (timeout), after which that read never touches its row.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "blob_file.h"
#include "pool_writer.h"

namespace es {

enum ReadState : int { kPending = 0, kCopying, kDone, kFailed, kAbandoned };

// The reads of one batch of records, shared by whoever waits for them and the reader
// threads. All fields are guarded by mu.
struct ReadBatch {
  explicit ReadBatch(size_t n) : state(n, kPending), error(n) {}
  // Waits until every read has settled; timeout_ms (0: no limit) without any read
  // settling gives the Pending ones up (copies in progress end soon). `give_up`: gives
  // every read not yet copying up at once.
  void settle(int timeout_ms, bool give_up);

  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> state;
  std::vector<std::exception_ptr> error;
  size_t settled = 0;  // reads Done, Failed or Abandoned
};

// The ReadTimeout of a read of record `expert` of `file` given up after timeout_ms
// without any read finishing.
std::exception_ptr read_timeout(const BlobFile& file, int expert, int timeout_ms);

// The calling thread's reusable O_DIRECT bounce buffer, of at least `bytes` bytes,
// page-locked where `writer` copies through CUDA (PoolWriter::pin). A reader thread
// serves one cache, so one writer. A buffer pinned before the cache staged its writes
// stays (retired, not unpinned) when it is outgrown while they are staged: unpinning is
// a runtime call, which a reader thread must not make while an acquire kernel may spin
// (mailbox.h).
uint8_t* bounce_buffer(size_t bytes, const PoolWriter& writer);

}  // namespace es
