// The shared-memory collectives of dabba/distributed/shm_communicator.py, for the native layer
// loop (decode_cpu.cpp) of a tensor-parallel rank: the same segment, layout and protocol, and the
// same sums in rank order, so that the loop's hidden states equal the Python layers' bit for bit.
// A rank's flag in the segment is the number of its last collective; each collective reads its
// number from there, so this group and the Python communicator take turns on one segment (the
// embedding's all-reduce and the LM head's gather stay in Python) without sharing a counter.
// Layout, spin count and timeout come from Python (ShmCommunicator), which defines them once.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace dabba {

class ShmGroup {
 public:
  ShmGroup(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, int64_t flag_stride,
           int64_t spin_before_yield, double timeout_s);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int64_t size() const { return size_; }
  int64_t rank() const { return rank_; }

  // The sum of every rank's x (the same shape on each), added in rank order.
  at::Tensor all_reduce(const at::Tensor& x);
  // Every rank's x concatenated along the last dimension, in rank order.
  at::Tensor all_gather(const at::Tensor& x);

 private:
  // Collective number flag(rank) + 1: this rank's ``piece`` (contiguous, at most a slot) into its
  // slot, then every rank's, as views of the segment valid until this rank's next collective.
  std::vector<at::Tensor> exchange(const at::Tensor& piece);
  int64_t* flag(int64_t r) const;
  uint8_t* slot(int64_t buffer, int64_t r) const;

  int64_t rank_, size_, slot_bytes_, flag_stride_, spin_before_yield_;
  double timeout_s_;
  size_t bytes_;
  uint8_t* base_ = nullptr;
};

}  // namespace dabba
