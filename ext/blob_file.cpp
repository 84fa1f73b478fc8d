#include "blob_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "checksum.h"

namespace es {

Fault fault_from_name(const std::string& name) {
  if (name == "none") return Fault::kNone;
  if (name == "eio") return Fault::kEIO;
  if (name == "short_read") return Fault::kShortRead;
  if (name == "corrupt") return Fault::kCorrupt;
  if (name == "delay") return Fault::kDelay;
  throw std::invalid_argument("unknown fault '" + name +
                              "' (none, eio, short_read, corrupt, delay)");
}

namespace {
constexpr size_t kAlign = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Buffers of a megabyte or more are aligned to 2 MiB and backed by huge pages where the
// kernel allows it: uncached reads into them pin far fewer pages per read than into 4 KiB
// pages, for several times the bandwidth.
size_t alignment(size_t bytes) { return bytes >= (size_t{1} << 20) ? kHugePage : kAlign; }
}  // namespace

size_t AlignedBuffer::allocated_bytes(size_t bytes) {
  const size_t align = alignment(bytes);
  const size_t rounded = (bytes + align - 1) / align * align;
  return rounded == 0 ? kAlign : rounded;
}

AlignedBuffer::AlignedBuffer(size_t bytes) : size_(bytes) {
  const size_t align = alignment(bytes), rounded = allocated_bytes(bytes);
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded) != 0) throw std::bad_alloc();
#if defined(__linux__)
  if (align == kHugePage) ::madvise(p, rounded, MADV_HUGEPAGE);
#endif
  data_ = static_cast<uint8_t*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

namespace {

// Whether any of `count` values of type T from `p` has every bit of `exponent` set.
template <typename T>
bool any_non_finite(const uint8_t* p, int64_t count, uint32_t exponent) {
  const auto mask = static_cast<T>(exponent);
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    bad |= (v & mask) == mask;
  }
  return bad;
}

}  // namespace

BlobFile::BlobFile(std::string path, int layer, int64_t num_records, int64_t stride,
                   int64_t record_bytes, std::vector<uint32_t> checksums, bool uncached,
                   std::vector<FloatSpan> floats, std::vector<SegmentSource> sources)
    : path_(std::move(path)),
      layer_(layer),
      num_records_(num_records),
      stride_(stride),
      record_bytes_(record_bytes),
      checksums_(std::move(checksums)),
      floats_(std::move(floats)),
      uncached_(uncached) {
  for (const auto& f : floats_)
    if ((f.width != 2 && f.width != 4) || f.offset < 0 || f.count < 0 ||
        f.offset + f.count * f.width > record_bytes_)
      throw ReadError(path_ + ": float segment " + f.key + " lies outside the record");
  if (stride_ <= 0 || stride_ % static_cast<int64_t>(kAlign) != 0 || record_bytes_ > stride_)
    throw ReadError(path_ + ": stride " + std::to_string(stride_) +
                    " must be a positive multiple of 4096 and >= record_bytes " +
                    std::to_string(record_bytes_));
  if (static_cast<int64_t>(checksums_.size()) != num_records_)
    throw ReadError(path_ + ": " + std::to_string(checksums_.size()) + " checksums for " +
                    std::to_string(num_records_) + " experts");
  try {
    if (sources.empty()) {
      const int64_t size = open_file(path_);
      const int64_t want = num_records_ * stride_;
      if (size != want)
        throw ReadError(path_ + (size < want ? ": truncated: " : ": wrong size: ") +
                        std::to_string(size) + " bytes, the manifest says " +
                        std::to_string(num_records_) + " experts x stride " +
                        std::to_string(stride_) + " = " + std::to_string(want));
      return;
    }
    if (sources.size() > 255)  // a ring read's tag holds the span in 8 bits
      throw ReadError(path_ + ": " + std::to_string(sources.size()) + " segments (at most 255)");
    int64_t total = 0, buffer = 0;
    std::vector<int64_t> sizes;
    for (const auto& src : sources) {
      if (src.offset < 0 || src.nbytes <= 0)
        throw ReadError(src.path + ": a segment at offset " + std::to_string(src.offset) +
                        " of " + std::to_string(src.nbytes) + " bytes (layer " +
                        std::to_string(layer_) + ")");
      auto it = std::find(paths_.begin(), paths_.end(), src.path);
      const int file = static_cast<int>(it - paths_.begin());
      if (it == paths_.end()) sizes.push_back(open_file(src.path));
      const int64_t end = src.offset + num_records_ * src.nbytes;
      if (sizes[static_cast<size_t>(file)] < end)
        throw ReadError(src.path + ": truncated: " +
                        std::to_string(sizes[static_cast<size_t>(file)]) +
                        " bytes, but the experts of layer " + std::to_string(layer_) +
                        " reach byte " + std::to_string(end));
      sources_.push_back(Source{file, src.offset, src.nbytes});
      total += src.nbytes;
      buffer += (src.nbytes + static_cast<int64_t>(kAlign) - 1) / kAlign * kAlign + kAlign;
    }
    if (total != record_bytes_ || buffer > stride_)
      throw ReadError(path_ + ": segments of " + std::to_string(total) +
                      " bytes in a read buffer of " + std::to_string(buffer) +
                      " for records of " + std::to_string(record_bytes_) +
                      " bytes and a stride of " + std::to_string(stride_) + " (layer " +
                      std::to_string(layer_) + ")");
  } catch (...) {
    for (int fd : fds_) ::close(fd);
    throw;
  }
}

int64_t BlobFile::open_file(const std::string& path) {
  int fd = -1;
  bool direct = false;
#if defined(__linux__)
  if (uncached_) {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    direct = fd >= 0;
  }
#endif
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ReadError(path + ": cannot open: " + errno_text(errno));
#if defined(__APPLE__)
  if (uncached_) ::fcntl(fd, F_NOCACHE, 1);
#endif
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw ReadError(path + ": cannot stat: " + errno_text(err));
  }
  fds_.push_back(fd);
  paths_.push_back(path);
  direct_.push_back(direct ? 1 : 0);
  return static_cast<int64_t>(st.st_size);
}

BlobFile::~BlobFile() {
  for (int fd : fds_) ::close(fd);
}

std::string BlobFile::where(int expert, int file) const {
  return (file >= 0 ? paths_[static_cast<size_t>(file)] : path_) + " (layer " +
         std::to_string(layer_) + ", expert " + std::to_string(expert) + ")";
}

void BlobFile::inject_fault(Fault fault, int expert, int count, int delay_ms) {
  std::lock_guard<std::mutex> lk(fault_mu_);
  armed_ = Armed{fault, expert, count, delay_ms};
  armed_any_.store(fault != Fault::kNone && count > 0);
}

Fault BlobFile::take_fault(int expert, int* delay_ms) const {
  if (!armed_any_.load(std::memory_order_relaxed)) return Fault::kNone;
  std::lock_guard<std::mutex> lk(fault_mu_);
  if (armed_.count <= 0 || (armed_.expert >= 0 && armed_.expert != expert)) return Fault::kNone;
  *delay_ms = armed_.delay_ms;
  if (--armed_.count == 0) armed_any_.store(false);
  return armed_.fault;
}

ReadError BlobFile::read_failed(int expert, int err, int span) const {
  std::vector<ReadSpan> all;
  int file = -1;
  if (span >= 0 && in_place()) {
    spans(expert, &all);
    file = all[static_cast<size_t>(span)].file;
  }
  return ReadError(where(expert, file) + ": read failed: " + errno_text(err));
}

void BlobFile::check_expert(int expert) const {
  if (expert < 0 || expert >= num_records_)
    throw ReadError(where(expert) + ": expert id out of range [0, " +
                    std::to_string(num_records_) + ")");
}

void BlobFile::spans(int expert, std::vector<ReadSpan>* out) const {
  out->clear();
  if (!in_place()) {
    const auto stride = static_cast<size_t>(stride_);
    out->push_back(ReadSpan{0, static_cast<int64_t>(expert) * stride_, stride, 0, 0, stride, 0});
    return;
  }
  const auto align = static_cast<int64_t>(kAlign);
  size_t at = 0, dest = 0;
  for (const auto& src : sources_) {
    const int64_t begin = src.offset + static_cast<int64_t>(expert) * src.nbytes;
    const int64_t first = begin / align * align;
    const int64_t last = (begin + src.nbytes + align - 1) / align * align;
    const auto length = static_cast<size_t>(src.nbytes);
    out->push_back(ReadSpan{src.file, first, static_cast<size_t>(last - first), at,
                            static_cast<size_t>(begin - first), length, dest});
    at += static_cast<size_t>(last - first);
    dest += length;
  }
}

size_t BlobFile::read_bytes(int file, uint8_t* dst, size_t bytes, size_t need, off_t base,
                            int* err) const {
  size_t got = 0;
  *err = 0;
  const bool direct = this->direct(file);
  while (got < need) {
    ssize_t n = ::pread(fd(file), dst + got, bytes - got, base + static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      break;
    }
    if (n == 0) break;  // end of file: never read zeros past it
    got += static_cast<size_t>(n);
    // O_DIRECT continues only at aligned offsets; a misaligned short read is an error.
    if (direct && got % kAlign != 0 && got < need) break;
  }
  return got;
}

size_t BlobFile::read_once(int expert, uint8_t* dst, Fault fault, int delay_ms) const {
  if (fault == Fault::kEIO) throw read_failed(expert, EIO, 0);
  if (fault == Fault::kDelay) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  std::vector<ReadSpan> all;
  spans(expert, &all);
  size_t arrived = 0;
  for (size_t j = 0; j < all.size(); ++j) {
    const ReadSpan& sp = all[j];
    const size_t bytes = asked(sp, j, fault);
    int err = 0;
    const size_t got = read_bytes(sp.file, dst + sp.at, bytes,
                                  std::min(bytes, sp.need()), static_cast<off_t>(sp.offset),
                                  &err);
    if (err) throw read_failed(expert, err, static_cast<int>(j));
    arrived += std::min(got, sp.need());
  }
  return arrived;
}

void BlobFile::finish_record(int expert, uint8_t* buf, size_t got, Fault fault,
                             bool verify) const {
  std::vector<ReadSpan> all;
  spans(expert, &all);
  size_t want = 0;
  for (const auto& sp : all) want += sp.need();
  if (got < want)
    throw ReadError(where(expert) + ": short read: " + std::to_string(got) + " of " +
                    std::to_string(want) + " bytes");
  for (const auto& sp : all) {
#if defined(__linux__)
    if (uncached_ && !direct(sp.file))
      ::posix_fadvise(fds_[static_cast<size_t>(sp.file)], static_cast<off_t>(sp.offset),
                      static_cast<off_t>(sp.bytes), POSIX_FADV_DONTNEED);
#endif
    // In record order each span's bytes move down (dest <= at + skip) and never onto a
    // later span's bytes (dest + length <= the next span's at).
    if (sp.at + sp.skip != sp.dest) std::memmove(buf + sp.dest, buf + sp.at + sp.skip, sp.length);
  }
  check_record(expert, buf, fault, verify);
}

void BlobFile::check_record(int expert, uint8_t* buf, Fault fault, bool verify) const {
  if (fault == Fault::kCorrupt) buf[0] ^= 0xFF;
  if (!verify) return;
  const uint32_t crc = record_crc32(buf, static_cast<size_t>(record_bytes_));
  if (crc != checksums_[expert])
    throw ChecksumError(where(expert) + ": checksum mismatch: crc32 " + std::to_string(crc) +
                        ", the manifest says " + std::to_string(checksums_[expert]));
  for (const auto& f : floats_) {
    const uint8_t* p = buf + f.offset;
    if (f.width == 2 ? any_non_finite<uint16_t>(p, f.count, f.exponent)
                     : any_non_finite<uint32_t>(p, f.count, f.exponent))
      throw ChecksumError(where(expert) + ": " + f.key +
                          " holds NaN or infinity (a damaged store)");
  }
}

void BlobFile::read_record(int expert, uint8_t* dst, bool verify, int attempts) const {
  check_expert(expert);
  for (int attempt = 1;; ++attempt) {
    try {
      int delay_ms = 0;
      const Fault fault = take_fault(expert, &delay_ms);
      finish_record(expert, dst, read_once(expert, dst, fault, delay_ms), fault, verify);
      return;
    } catch (const ReadError&) {
      if (attempt < attempts) continue;  // a retry, after a failed read or a checksum mismatch
      throw;
    }
  }
}

void BlobFile::read_run(int first, int count, uint8_t* dst, bool verify,
                        std::vector<uint8_t>& ok) const {
  check_expert(first);
  check_expert(first + count - 1);
  ok.assign(static_cast<size_t>(count), 0);
  const auto stride = static_cast<size_t>(stride_);
  std::vector<Fault> faults(static_cast<size_t>(count));
  int delay_ms = 0;
  for (int i = 0; i < count; ++i) {
    int d = 0;
    faults[static_cast<size_t>(i)] = take_fault(first + i, &d);
    if (faults[static_cast<size_t>(i)] == Fault::kDelay) delay_ms = std::max(delay_ms, d);
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  if (in_place()) {
    read_run_in_place(first, count, dst, verify, faults, ok);
    return;
  }
  int err = 0;
  const size_t bytes = static_cast<size_t>(count) * stride;
  const size_t got = read_bytes(0, dst, bytes, bytes,
                                static_cast<off_t>(static_cast<int64_t>(first) * stride_), &err);
  for (int i = 0; i < count; ++i) {
    const Fault fault = faults[static_cast<size_t>(i)];
    if (fault == Fault::kEIO || fault == Fault::kShortRead) continue;  // its attempt failed
    if (got < static_cast<size_t>(i + 1) * stride) break;
    try {
      finish_record(first + i, dst + static_cast<size_t>(i) * stride, stride, fault, verify);
      ok[static_cast<size_t>(i)] = 1;
    } catch (const ReadError&) {
      // read again on its own: read_record's second attempt words any error
    }
  }
}

void BlobFile::read_run_in_place(int first, int count, uint8_t* dst, bool verify,
                                 const std::vector<Fault>& faults,
                                 std::vector<uint8_t>& ok) const {
  const auto align = static_cast<int64_t>(kAlign);
  const auto stride = static_cast<size_t>(stride_);
  size_t biggest = 0;
  for (const auto& src : sources_)
    biggest = std::max(biggest, static_cast<size_t>(count * src.nbytes + 2 * align));
  AlignedBuffer run(biggest);
  std::vector<uint8_t> arrived(static_cast<size_t>(count), 1);
  size_t dest = 0;
  for (const auto& src : sources_) {
    // The segment of every record of the run: adjacent in its file, one read.
    const int64_t begin = src.offset + static_cast<int64_t>(first) * src.nbytes;
    const int64_t lo = begin / align * align;
    const int64_t hi = (begin + count * src.nbytes + align - 1) / align * align;
    const auto skip = static_cast<size_t>(begin - lo);
    const auto n = static_cast<size_t>(src.nbytes);
    int err = 0;
    const size_t got = read_bytes(src.file, run.data(), static_cast<size_t>(hi - lo),
                                  skip + static_cast<size_t>(count) * n, static_cast<off_t>(lo),
                                  &err);
#if defined(__linux__)
    if (uncached_ && !direct(src.file))
      ::posix_fadvise(fd(src.file), static_cast<off_t>(lo), static_cast<off_t>(hi - lo),
                      POSIX_FADV_DONTNEED);
#endif
    for (int i = 0; i < count; ++i) {
      const size_t at = skip + static_cast<size_t>(i) * n;
      if (err != 0 || got < at + n) {
        arrived[static_cast<size_t>(i)] = 0;
        continue;
      }
      std::memcpy(dst + static_cast<size_t>(i) * stride + dest, run.data() + at, n);
    }
    dest += n;
  }
  for (int i = 0; i < count; ++i) {
    const Fault fault = faults[static_cast<size_t>(i)];
    if (fault == Fault::kEIO || fault == Fault::kShortRead || !arrived[static_cast<size_t>(i)])
      continue;  // its attempt failed
    try {
      check_record(first + i, dst + static_cast<size_t>(i) * stride, fault, verify);
      ok[static_cast<size_t>(i)] = 1;
    } catch (const ReadError&) {
      // read again on its own: read_record's second attempt words any error
    }
  }
}

}  // namespace es
