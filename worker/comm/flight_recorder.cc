#include "worker/comm/flight_recorder.h"

#include <algorithm>
#include <thread>
#include <utility>

namespace concord::comm {
namespace {

// Beyond this many in flight (a program that never heartbeats polls
// nothing), Issued sweeps the ended ones itself.
constexpr size_t kSweepAt = 4096;

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
}

}  // namespace

void FlightRecorder::BeginGeneration(int64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (generation <= generation_) return;
  generation_ = generation;
  collectives_ = 0;
}

void FlightRecorder::Issued(int64_t generation, bool main, const char* kind,
                            int64_t bytes, const std::shared_ptr<Work>& work) {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = in_flight_.emplace_back();
  e.record.generation = generation;
  if (main && generation == generation_) e.record.seq = ++collectives_;
  e.record.kind = kind;
  e.record.bytes = bytes;
  e.record.issued = now;
  e.work = work;
  if (in_flight_.size() >= kSweepAt) Sweep(now);
}

void FlightRecorder::Sweep(absl::Time now) {
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    std::shared_ptr<Work> work = it->work.lock();
    if (work != nullptr && !work->IsCompleted()) {
      ++it;
      continue;
    }
    // Ended; a work nobody holds any more ended by the time it was let go.
    CollectiveRecord record = std::move(it->record);
    const std::optional<absl::Time> at =
        work != nullptr ? work->CompletedAt() : std::nullopt;
    record.ended = at.value_or(now);
    done_.push_back(std::move(record));
    if (done_.size() > kKept) done_.pop_front();
    it = in_flight_.erase(it);
  }
}

FlightRecorder::Snapshot FlightRecorder::Poll(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  Sweep(now);
  Snapshot s;
  s.generation = generation_;
  s.collectives = collectives_;
  for (const Entry& e : in_flight_) {
    if (e.record.generation != generation_) continue;
    s.pending = e.record;
    break;
  }
  // The last to end: done_ is in the order ends were seen, not ended.
  for (const CollectiveRecord& r : done_) {
    if (!s.last.has_value() || *r.ended >= *s.last->ended) s.last = r;
  }
  return s;
}

void FlightRecorder::Waited(absl::Duration d) {
  std::lock_guard<std::mutex> lock(mu_);
  waited_ += d;
}

absl::Duration FlightRecorder::waited() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waited_;
}

namespace {

// A recorded collective's work: the inner one's, with the time its callers
// block in Wait or Synchronize added to the recorder's.
class RecordedWork final : public Work {
 public:
  RecordedWork(std::shared_ptr<Work> inner,
               std::shared_ptr<FlightRecorder> recorder)
      : inner_(std::move(inner)), recorder_(std::move(recorder)) {}
  bool IsCompleted() const override { return inner_->IsCompleted(); }
  absl::Status Wait(absl::Duration timeout) override {
    return Timed([&] { return inner_->Wait(timeout); });
  }
  absl::Status Synchronize(absl::Duration timeout) override {
    return Timed([&] { return inner_->Synchronize(timeout); });
  }
  void Abort() override { inner_->Abort(); }
  std::optional<absl::Time> CompletedAt() const override {
    return inner_->CompletedAt();
  }

 private:
  template <typename Fn>
  absl::Status Timed(Fn wait) {
    const absl::Time start = absl::Now();
    absl::Status s = wait();
    recorder_->Waited(absl::Now() - start);
    return s;
  }

  std::shared_ptr<Work> inner_;
  std::shared_ptr<FlightRecorder> recorder_;
};

}  // namespace

std::vector<CollectiveRecord> FlightRecorder::Recent() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CollectiveRecord> out(done_.begin(), done_.end());
  for (const Entry& e : in_flight_) out.push_back(e.record);
  std::stable_sort(out.begin(), out.end(),
                   [](const CollectiveRecord& a, const CollectiveRecord& b) {
                     return a.issued < b.issued;
                   });
  if (out.size() > kKept) out.erase(out.begin(), out.end() - kKept);
  return out;
}

RecordedCommunicator::RecordedCommunicator(
    std::shared_ptr<Communicator> inner,
    std::shared_ptr<FlightRecorder> recorder, bool main)
    : inner_(std::move(inner)), recorder_(std::move(recorder)), main_(main) {
  if (main_) recorder_->BeginGeneration(inner_->generation());
}

RecordedCommunicator::~RecordedCommunicator() {
  if (!aborted_.load() || inner_ == nullptr) return;
  std::thread([inner = std::move(inner_)]() mutable {
    inner.reset();
  }).detach();
}

std::shared_ptr<Communicator> RecordedCommunicator::Inner(
    const std::shared_ptr<Communicator>& c) {
  if (const auto* r = dynamic_cast<const RecordedCommunicator*>(c.get())) {
    return r->inner_;
  }
  return c;
}

std::shared_ptr<Work> RecordedCommunicator::Record(const char* kind,
                                                   int64_t bytes,
                                                   std::shared_ptr<Work> work) {
  recorder_->Issued(inner_->generation(), main_, kind, bytes, work);
  return std::make_shared<RecordedWork>(std::move(work), recorder_);
}

std::shared_ptr<Work> RecordedCommunicator::AllreduceSum(
    at::Tensor tensor, const CollectiveOptions& options) {
  const int64_t bytes = Bytes(tensor);
  return Record("allreduce", bytes,
                inner_->AllreduceSum(std::move(tensor), options));
}

std::shared_ptr<Work> RecordedCommunicator::Broadcast(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  const int64_t bytes = Bytes(tensor);
  return Record("broadcast", bytes,
                inner_->Broadcast(std::move(tensor), root, options));
}

std::shared_ptr<Work> RecordedCommunicator::Allgather(
    at::Tensor output, at::Tensor input, const CollectiveOptions& options) {
  const int64_t bytes = Bytes(input);
  return Record(
      "allgather", bytes,
      inner_->Allgather(std::move(output), std::move(input), options));
}

std::shared_ptr<Work> RecordedCommunicator::ReduceSum(
    at::Tensor tensor, int root, const CollectiveOptions& options) {
  const int64_t bytes = Bytes(tensor);
  return Record("reduce", bytes,
                inner_->ReduceSum(std::move(tensor), root, options));
}

std::shared_ptr<Work> RecordedCommunicator::Exchange(
    at::Tensor send, std::vector<int> to, std::vector<at::Tensor> recv,
    std::vector<int> from, const CollectiveOptions& options) {
  const int64_t bytes = Bytes(send) * static_cast<int64_t>(to.size());
  return Record("exchange", bytes,
                inner_->Exchange(std::move(send), std::move(to),
                                 std::move(recv), std::move(from), options));
}

}  // namespace concord::comm
