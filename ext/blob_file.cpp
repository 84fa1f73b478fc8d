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
                   std::vector<FloatSpan> floats)
    : path_(std::move(path)),
      layer_(layer),
      num_records_(num_records),
      stride_(stride),
      record_bytes_(record_bytes),
      checksums_(std::move(checksums)),
      floats_(std::move(floats)) {
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
#if defined(__linux__)
  if (uncached) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    direct_ = fd_ >= 0;
  }
#endif
  if (fd_ < 0) fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw ReadError(path_ + ": cannot open: " + errno_text(errno));
#if defined(__APPLE__)
  if (uncached) ::fcntl(fd_, F_NOCACHE, 1);
#elif defined(__linux__)
  fadvise_ = uncached && !direct_;
#endif
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    throw ReadError(path_ + ": cannot stat: " + errno_text(err));
  }
  const int64_t want = num_records_ * stride_;
  if (st.st_size != want) {
    ::close(fd_);
    throw ReadError(path_ + (st.st_size < want ? ": truncated: " : ": wrong size: ") +
                    std::to_string(st.st_size) + " bytes, the manifest says " +
                    std::to_string(num_records_) + " experts x stride " +
                    std::to_string(stride_) + " = " + std::to_string(want));
  }
}

BlobFile::~BlobFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string BlobFile::where(int expert) const {
  return path_ + " (layer " + std::to_string(layer_) + ", expert " + std::to_string(expert) + ")";
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

ReadError BlobFile::read_failed(int expert, int err) const {
  return ReadError(where(expert) + ": read failed: " + errno_text(err));
}

void BlobFile::check_expert(int expert) const {
  if (expert < 0 || expert >= num_records_)
    throw ReadError(where(expert) + ": expert id out of range [0, " +
                    std::to_string(num_records_) + ")");
}

size_t BlobFile::read_bytes(uint8_t* dst, size_t want, off_t base, int* err) const {
  size_t got = 0;
  *err = 0;
  while (got < want) {
    ssize_t n = ::pread(fd_, dst + got, want - got, base + static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      break;
    }
    if (n == 0) break;  // end of file: never read zeros past it
    got += static_cast<size_t>(n);
    // O_DIRECT continues only at aligned offsets; a misaligned short read is an error.
    if (direct_ && got % kAlign != 0 && got < want) break;
  }
  return got;
}

size_t BlobFile::read_once(int expert, uint8_t* dst, Fault fault, int delay_ms) const {
  if (fault == Fault::kEIO) throw read_failed(expert, EIO);
  if (fault == Fault::kDelay) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  size_t want = static_cast<size_t>(stride_);
  if (fault == Fault::kShortRead) want /= 2;
  int err = 0;
  const size_t got = read_bytes(dst, want, static_cast<off_t>(offset(expert)), &err);
  if (err) throw read_failed(expert, err);
  return got;
}

void BlobFile::finish_record(int expert, uint8_t* buf, size_t got, Fault fault,
                             bool verify) const {
  if (got < static_cast<size_t>(stride_))
    throw ReadError(where(expert) + ": short read: " + std::to_string(got) + " of " +
                    std::to_string(stride_) + " bytes");
#if defined(__linux__)
  if (fadvise_)
    ::posix_fadvise(fd_, static_cast<off_t>(offset(expert)), static_cast<off_t>(stride_),
                    POSIX_FADV_DONTNEED);
#endif
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
  std::vector<Fault> faults(static_cast<size_t>(count));
  int delay_ms = 0;
  for (int i = 0; i < count; ++i) {
    int d = 0;
    faults[static_cast<size_t>(i)] = take_fault(first + i, &d);
    if (faults[static_cast<size_t>(i)] == Fault::kDelay) delay_ms = std::max(delay_ms, d);
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  ok.assign(static_cast<size_t>(count), 0);
  int err = 0;
  const auto stride = static_cast<size_t>(stride_);
  const size_t got = read_bytes(dst, static_cast<size_t>(count) * stride,
                                static_cast<off_t>(offset(first)), &err);
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

}  // namespace es
