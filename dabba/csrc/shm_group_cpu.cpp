// ShmGroup (shm_group.h): dabba/distributed/shm_communicator.py's collectives, in C++.
#include "shm_group.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace dabba {

ShmGroup::ShmGroup(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, int64_t flag_stride,
                   int64_t spin_before_yield, double timeout_s)
    : rank_(rank), size_(size), slot_bytes_(slot_bytes), flag_stride_(flag_stride),
      spin_before_yield_(spin_before_yield), timeout_s_(timeout_s) {
  TORCH_CHECK(size >= 2 && rank >= 0 && rank < size, "ShmGroup: rank ", rank, " of ", size);
  TORCH_CHECK(flag_stride >= 8 && flag_stride % 8 == 0 && slot_bytes > 0, "ShmGroup: bad layout");
  bytes_ = static_cast<size_t>(size * flag_stride + 2 * size * slot_bytes);  // segment_size() in Python
  const int fd = open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "ShmGroup: cannot open ", path);
  void* mapped = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(mapped != MAP_FAILED, "ShmGroup: cannot map ", path);
  base_ = static_cast<uint8_t*>(mapped);
}

ShmGroup::~ShmGroup() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

int64_t* ShmGroup::flag(int64_t r) const { return reinterpret_cast<int64_t*>(base_ + r * flag_stride_); }

uint8_t* ShmGroup::slot(int64_t buffer, int64_t r) const {
  return base_ + size_ * flag_stride_ + (buffer * size_ + r) * slot_bytes_;
}

std::vector<at::Tensor> ShmGroup::exchange(const at::Tensor& piece) {
  const int64_t count = __atomic_load_n(flag(rank_), __ATOMIC_ACQUIRE) + 1;
  const int64_t buffer = count % 2, nbytes = piece.numel() * piece.element_size();
  std::memcpy(slot(buffer, rank_), piece.data_ptr(), static_cast<size_t>(nbytes));
  __atomic_store_n(flag(rank_), count, __ATOMIC_RELEASE);
  int64_t spins = 0;
  std::chrono::steady_clock::time_point deadline;
  for (int64_t r = 0; r < size_; ++r) {
    while (__atomic_load_n(flag(r), __ATOMIC_ACQUIRE) < count) {
      if (++spins <= spin_before_yield_) continue;
      sched_yield();  // a long wait: the other rank is prefilling, or its core is shared
      const auto now = std::chrono::steady_clock::now();
      if (spins == spin_before_yield_ + 1)
        deadline = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(timeout_s_));
      TORCH_CHECK(now <= deadline, "tensor-parallel rank ", rank_, ": the other ranks did not reach collective ",
                  count, " within ", timeout_s_, " s");
    }
  }
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < size_; ++r)
    parts.push_back(at::from_blob(slot(buffer, r), {piece.numel()}, piece.options()));
  return parts;
}

at::Tensor ShmGroup::all_reduce(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  const at::Tensor src = x.contiguous().view(-1);
  at::Tensor dst = out.view(-1);
  const int64_t step = slot_bytes_ / x.element_size(), numel = src.numel();
  for (int64_t start = 0; start < numel; start += step) {
    const int64_t len = std::min(step, numel - start);
    const std::vector<at::Tensor> parts = exchange(src.narrow(0, start, len));
    at::Tensor total = dst.narrow(0, start, len);
    at::add_out(total, parts[0], parts[1]);  // as torch.add(parts[0], parts[1], out=total)
    for (int64_t r = 2; r < size_; ++r) total.add_(parts[r]);
  }
  return out;
}

at::Tensor ShmGroup::all_gather(const at::Tensor& x) {
  const at::Tensor src = x.contiguous().view(-1);
  const int64_t step = slot_bytes_ / x.element_size(), numel = src.numel();
  at::Tensor gathered = at::empty({size_, numel}, x.options());
  for (int64_t start = 0; start < numel; start += step) {
    const int64_t len = std::min(step, numel - start);
    const std::vector<at::Tensor> parts = exchange(src.narrow(0, start, len));
    for (int64_t r = 0; r < size_; ++r) gathered[r].narrow(0, start, len).copy_(parts[r]);
  }
  std::vector<int64_t> shape{size_};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  return at::cat(gathered.view(shape).unbind(0), -1);
}

}  // namespace dabba
