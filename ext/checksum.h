// The crc32 of a record, as the store's manifest records it (zlib's crc32, the polynomial
// of gzip and PNG; docs/store-format.md), computed by libdeflate where the build found it
// (carry-less multiply, several times zlib's rate), else by zlib.
//
// At zlib's rate a 30B-class expert record (2.8 MB) takes longer to check than to read
// from an NVMe disk, and the thread that waits for a batch of reads (io_uring,
// ext/ring_reader.h) checks each record in turn, so checksums alone would hold reads well
// below the disk's rate. A large buffer is therefore split into chunks that helper threads
// and the caller check side by side, joined with zlib's crc32_combine (the crc of a
// concatenation from the crcs of its parts).
#pragma once

#include <cstddef>
#include <cstdint>

namespace es {

// Buffers of at least this many bytes are split; smaller ones are checked by the caller
// alone (a 61 KB record takes 6-27 us, about what handing work to another thread and back
// costs).
constexpr size_t kSplitBytes = 1 << 20;
// Bytes per chunk of a split buffer.
constexpr size_t kChunkBytes = 256 << 10;

// crc32(0, buf, n) as zlib computes it. Thread-safe. The caller claims chunks too, and
// waits only for chunks a helper has already started, so it finishes even when every
// helper is busy with other callers' chunks. Helpers: one process-wide pool of
// min(cores - 1, 7) threads, started on the first split buffer; a child forked after
// that has none of them and checks alone.
uint32_t record_crc32(const uint8_t* buf, size_t n);

// "libdeflate" or "zlib": which library computes the chunks.
const char* crc32_implementation();

}  // namespace es
