// The records of one MoE layer, opened for positional, uncached reads: a layerNN.blob of a
// blob store, or the stacked expert tensors of a checkpoint's own safetensors files (an
// in-place store).
//
// A record is read as a list of spans (ReadSpan), each a read of one file into the record
// buffer. In a blob, record e is one span: the stride bytes at e * stride, record_bytes of
// them meaningful (docs/store-format.md). In place, record e is one span per segment: the
// segment's nbytes at offset + e * nbytes of its file (SegmentSource), read from the
// 4096-aligned offset below to the 4096-aligned end above, at increasing aligned places
// of the buffer, then moved together into the record's layout. Reads bypass the page
// cache where the OS allows it: O_DIRECT on Linux (aligned buffer, aligned offsets and
// lengths), falling back to posix_fadvise DONTNEED where O_DIRECT is refused (tmpfs);
// F_NOCACHE on macOS.
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

// Where one segment of every record of an in-place store lies: record e's bytes of it are
// the `nbytes` at `offset + e * nbytes` of the file `path` (a checkpoint's stacked tensor).
struct SegmentSource {
  std::string path;
  int64_t offset = 0;
  int64_t nbytes = 0;
};

// One read of a record: `bytes` at `offset` of file `file` (BlobFile::fd) into the record
// buffer at `at`; the `length` bytes from `at + skip` are the record's bytes at `dest`.
// The read has done its part once need() bytes have arrived.
struct ReadSpan {
  int file = 0;
  int64_t offset = 0;
  size_t bytes = 0;
  size_t at = 0;
  size_t skip = 0;
  size_t length = 0;
  size_t dest = 0;
  size_t need() const { return skip + length; }
};

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
  // Without `sources`: opens the blob `path` and checks that it holds exactly
  // num_records * stride bytes. With `sources` (one per segment, in record order, their
  // nbytes summing to record_bytes): opens each distinct source file and checks that it
  // reaches the end of every segment it holds; `path` then only names the records in
  // messages, and `stride` is the read buffer a record needs (at least the sum over
  // segments of nbytes rounded up to 4096, plus 4096). Throws ReadError naming the file
  // when it cannot be opened or is too short ("truncated") or, for a blob, too long.
  // `floats`: the record's float segments, checked with the crc32.
  BlobFile(std::string path, int layer, int64_t num_records, int64_t stride,
           int64_t record_bytes, std::vector<uint32_t> checksums, bool uncached,
           std::vector<FloatSpan> floats = {}, std::vector<SegmentSource> sources = {});
  ~BlobFile();
  BlobFile(const BlobFile&) = delete;
  BlobFile& operator=(const BlobFile&) = delete;

  // Reads record `expert` (stride bytes) into `dst`, which must be 4096-aligned and
  // hold stride bytes. Retries EINTR and short reads; verifies the crc32 of the first
  // record_bytes bytes when `verify`; `attempts` 2 re-reads once after a failed read or a
  // mismatch (1: after read_run's attempt). Throws ReadError (or ChecksumError) naming
  // the file, layer and expert.
  void read_record(int expert, uint8_t* dst, bool verify, int attempts = 2) const;
  // Records first .. first + count - 1 into `dst` (4096-aligned, count * stride bytes),
  // record i at i * stride: in a blob, adjacent records in one read of count * stride
  // bytes (a few large reads go at the disk's rate where many small ones wait on its
  // latency); in place, one read per segment of the run's records (adjacent in the
  // segment's stacked tensor), each record's part copied into its place. The first attempt of each: ok[i] = 1 where
  // record first + i arrived whole (and with its crc32, when `verify`); the others take
  // read_record(..., 1), which words their error. Each record takes its armed fault as
  // that attempt: kEIO and kShortRead fail it, kCorrupt flips its first byte, kDelay
  // delays the read. Throws ReadError for an id out of range.
  void read_run(int first, int count, uint8_t* dst, bool verify, std::vector<uint8_t>& ok) const;

  // The pieces of read_record that another reader of these records (io_uring,
  // ext/ring_reader.h) shares, so that both follow the same rules: at most two attempts
  // per record (one retry after any ReadError, ChecksumError included); each attempt
  // takes the armed fault (take_fault), reads each of spans(expert) from fd(span.file)
  // (under kShortRead the first span asks for half its bytes, rounded down to 4096; none
  // under kEIO, which
  // fails as read_failed(EIO); each read continued after a short read until need()
  // bytes arrived, under O_DIRECT only at a 4096-aligned count, never past the end of
  // the file), then finish_record checks what arrived.
  int fd(int file) const { return fds_[static_cast<size_t>(file)]; }
  // The bytes an attempt under `fault` asks of span j of a record.
  static size_t asked(const ReadSpan& span, size_t j, Fault fault) {
    return fault == Fault::kShortRead && j == 0 ? span.bytes / 2 / 4096 * 4096 : span.bytes;
  }
  // The reads of record `expert` (in range), into a buffer of stride bytes.
  void spans(int expert, std::vector<ReadSpan>* out) const;
  // Throws ReadError unless expert is in [0, num_records).
  void check_expert(int expert) const;
  // The fault armed for the next read of `expert` (kNone mostly), counted as taken;
  // *delay_ms is set for kDelay.
  Fault take_fault(int expert, int* delay_ms) const;
  // ReadError "<where>: read failed: <strerror(err)>", naming the file of `span` in
  // place (-1: the record's).
  ReadError read_failed(int expert, int err, int span = -1) const;
  // One attempt's checks on the reads of record `expert` into `buf` (stride bytes,
  // 4096-aligned), `got` the bytes that arrived of what the spans need (each span's
  // arrival up to its need() summed): a short read (got < the sum of need()) throws
  // ReadError; then the page-cache hint where O_DIRECT was refused, the spans' bytes
  // moved into the record's layout (in place), the injected corruption (kCorrupt flips
  // buf[0]) and, when `verify`, the crc32 of the first record_bytes bytes (ChecksumError
  // on a mismatch) and the float segments (ChecksumError naming the first holding NaN or
  // infinity).
  void finish_record(int expert, uint8_t* buf, size_t got, Fault fault, bool verify) const;

  const std::string& path() const { return path_; }
  int64_t stride() const { return stride_; }
  int64_t record_bytes() const { return record_bytes_; }
  // Whether file `file` is read with O_DIRECT (a file system may refuse it).
  bool direct(int file = 0) const { return direct_[static_cast<size_t>(file)] != 0; }
  bool in_place() const { return !sources_.empty(); }

  // Arms a fault for the next `count` reads of `expert` (-1: any expert). Test hook.
  void inject_fault(Fault fault, int expert, int count, int delay_ms);

  // "<path> (layer <layer>, expert <expert>)", the prefix of every read error message;
  // with `file` >= 0, that file's path in place of `path`.
  std::string where(int expert, int file = -1) const;

 private:
  // The checks of finish_record on a record laid out in `buf`: the injected corruption,
  // the crc32 and the float segments.
  void check_record(int expert, uint8_t* buf, Fault fault, bool verify) const;
  // read_run of an in-place store, each record's fault already taken.
  void read_run_in_place(int first, int count, uint8_t* dst, bool verify,
                         const std::vector<Fault>& faults, std::vector<uint8_t>& ok) const;
  // One attempt with the fault already taken; returns the bytes that arrived of what
  // the spans need (finish_record's `got`).
  size_t read_once(int expert, uint8_t* dst, Fault fault, int delay_ms) const;
  // Up to `bytes` at `base` of file `file` into dst (EINTR retried, short reads continued
  // until `need` bytes arrived, at aligned counts under O_DIRECT); returns how many, *err
  // the errno of a failed read.
  size_t read_bytes(int file, uint8_t* dst, size_t bytes, size_t need, off_t base,
                    int* err) const;
  // Opens `path` as the next file (O_DIRECT when uncached_ and the file system allows);
  // returns its size. Throws ReadError naming it.
  int64_t open_file(const std::string& path);

  std::string path_;
  int layer_;
  int64_t num_records_;
  int64_t stride_;
  int64_t record_bytes_;
  std::vector<uint32_t> checksums_;
  std::vector<FloatSpan> floats_;
  struct Source {  // an in-place segment
    int file;
    int64_t offset, nbytes;
  };
  std::vector<Source> sources_;  // empty: a blob, file 0
  std::vector<int> fds_;
  std::vector<std::string> paths_;  // of fds_
  std::vector<uint8_t> direct_;     // per file: opened with O_DIRECT
  bool uncached_ = false;           // where O_DIRECT was refused: posix_fadvise after reads

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
