// One layerNN.blob opened for positional, uncached record reads.
//
// Record e lives at byte offset e * stride and holds record_bytes meaningful bytes
// (docs/store-format.md). Reads bypass the page cache where the OS allows it: O_DIRECT
// on Linux (aligned buffer, whole-stride reads), falling back to posix_fadvise
// DONTNEED where O_DIRECT is refused (tmpfs); F_NOCACHE on macOS.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <cstdint>
#include <string>
#include <vector>

#include <sys/types.h>

#include "errors.h"

namespace es {

// A test-only fault to inject into reads. kNone costs one branch.
enum class Fault : int { kNone = 0, kEIO = 1, kShortRead = 2, kCorrupt = 3, kDelay = 4 };
// The fault named "none", "eio", "short_read", "corrupt" or "delay"; std::invalid_argument
// naming the choices otherwise.
Fault fault_from_name(const std::string& name);

// A float segment of a record (scales, biases, unquantized weights): `count` values of
// `width` bytes (2 or 4) from byte `offset`, whose exponent bits are `exponent`. A value
// with every exponent bit set is NaN or infinity, which a checksum written to match does
// not reveal and which turns every reply empty.
struct FloatSpan {
  std::string key;
  int64_t offset;
  int64_t count;
  int width;
  uint32_t exponent;
};

class BlobFile {
 public:
  // Opens `path` and checks that it holds exactly num_records * stride bytes.
  // Throws ReadError naming the file when it cannot be opened or its size differs
  // ("truncated" when shorter). `floats`: the record's float segments, checked with the
  // crc32.
  BlobFile(std::string path, int layer, int64_t num_records, int64_t stride,
           int64_t record_bytes, std::vector<uint32_t> checksums, bool uncached,
           std::vector<FloatSpan> floats = {});
  ~BlobFile();
  BlobFile(const BlobFile&) = delete;
  BlobFile& operator=(const BlobFile&) = delete;

  // Reads record `expert` (stride bytes) into `dst`, which must be 4096-aligned and
  // hold stride bytes. Retries EINTR and short reads; verifies the crc32 of the first
  // record_bytes bytes when `verify`; `attempts` 2 re-reads once after a failed read or a
  // mismatch (1: after read_run's attempt). Throws ReadError (or ChecksumError) naming
  // the file, layer and expert.
  void read_record(int expert, uint8_t* dst, bool verify, int attempts = 2) const;
  // Records first .. first + count - 1, adjacent in the file, in one read of count *
  // stride bytes into `dst` (4096-aligned, that many bytes): a few large reads go at the
  // disk's rate where many small ones wait on its latency. The first attempt of each:
  // ok[i] = 1 where record first + i arrived whole (and with its crc32, when `verify`);
  // the others take read_record(..., 1), which words their error. Each record takes its
  // armed fault as that attempt: kEIO and kShortRead fail it, kCorrupt flips its first
  // byte, kDelay delays the whole read. Throws ReadError for an id out of range.
  void read_run(int first, int count, uint8_t* dst, bool verify, std::vector<uint8_t>& ok) const;

  // The pieces of read_record that another reader of this file's records (io_uring,
  // ext/ring_reader.h) shares, so that both follow the same rules: at most two attempts
  // per record (one retry after any ReadError, ChecksumError included); each attempt
  // takes the armed fault (take_fault), reads stride bytes at offset(expert) from fd()
  // (stride / 2 under kShortRead; none under kEIO, which fails as read_failed(EIO);
  // under O_DIRECT continuing after a short read only at a 4096-aligned count), then
  // finish_record checks what it got.
  int fd() const { return fd_; }
  int64_t offset(int expert) const { return static_cast<int64_t>(expert) * stride_; }
  // Throws ReadError unless expert is in [0, num_records).
  void check_expert(int expert) const;
  // The fault armed for the next read of `expert` (kNone mostly), counted as taken;
  // *delay_ms is set for kDelay.
  Fault take_fault(int expert, int* delay_ms) const;
  // ReadError "<where>: read failed: <strerror(err)>".
  ReadError read_failed(int expert, int err) const;
  // One attempt's checks on `got` bytes read into `buf` (stride bytes, 4096-aligned):
  // a short read (got < stride) throws ReadError; then the page-cache hint where
  // O_DIRECT was refused, the injected corruption (kCorrupt flips buf[0]) and, when
  // `verify`, the crc32 of the first record_bytes bytes (ChecksumError on a mismatch)
  // and the float segments (ChecksumError naming the first holding NaN or infinity).
  void finish_record(int expert, uint8_t* buf, size_t got, Fault fault, bool verify) const;

  const std::string& path() const { return path_; }
  int64_t stride() const { return stride_; }
  int64_t record_bytes() const { return record_bytes_; }
  bool direct() const { return direct_; }

  // Arms a fault for the next `count` reads of `expert` (-1: any expert). Test hook.
  void inject_fault(Fault fault, int expert, int count, int delay_ms);

  // "<path> (layer <layer>, expert <expert>)", the prefix of every read error message.
  std::string where(int expert) const;

 private:
  // One attempt with the fault already taken; returns the bytes read.
  size_t read_once(int expert, uint8_t* dst, Fault fault, int delay_ms) const;
  // Up to `want` bytes at `base` into dst (EINTR retried, short reads continued at
  // aligned counts under O_DIRECT); returns how many, *err the errno of a failed read.
  size_t read_bytes(uint8_t* dst, size_t want, off_t base, int* err) const;

  std::string path_;
  int layer_;
  int64_t num_records_;
  int64_t stride_;
  int64_t record_bytes_;
  std::vector<uint32_t> checksums_;
  std::vector<FloatSpan> floats_;
  int fd_ = -1;
  bool direct_ = false;
  bool fadvise_ = false;

  struct Armed {
    Fault fault = Fault::kNone;
    int expert = -1;
    int count = 0;
    int delay_ms = 0;
  };
  mutable std::mutex fault_mu_;
  mutable Armed armed_;
  mutable std::atomic<bool> armed_any_{false};
};

// Aligned scratch buffer for O_DIRECT reads.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  // The bytes a buffer of `bytes` allocates: rounded up to 4 KiB, or to 2 MiB (huge
  // pages) from 1 MiB on.
  static size_t allocated_bytes(size_t bytes);
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace es
