#include "coordinator/store/etcd_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace concord::coordinator {
namespace {

using etcdserverpb::Compare;

// A transaction step that puts `value` at `key` (with `lease` when not 0).
etcdserverpb::RequestOp PutOp(const std::string& key, const std::string& value,
                              int64_t lease) {
  etcdserverpb::RequestOp op;
  etcdserverpb::PutRequest* put = op.mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  return op;
}

// "the key's create_revision == revision" (0: the key does not exist).
Compare CreatedAt(const std::string& key, int64_t revision) {
  Compare c;
  c.set_result(Compare::EQUAL);
  c.set_target(Compare::CREATE);
  c.set_key(key);
  c.set_create_revision(revision);
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdStore>> EtcdStore::Create(
    std::unique_ptr<EtcdClient> client, EtcdStoreOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("no etcd client");
  if (options.prefix.empty()) {
    return absl::InvalidArgumentError("the etcd key prefix must not be empty");
  }
  if (options.lease_ttl < 1) {
    return absl::InvalidArgumentError(
        "the etcd lease TTL must be at least 1 second");
  }
  if (options.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the poll interval must be positive");
  }
  return std::unique_ptr<EtcdStore>(
      new EtcdStore(std::move(client), std::move(options)));
}

EtcdStore::~EtcdStore() { StopRenewing(); }

absl::StatusOr<std::string> EtcdStore::Leader() {
  etcdserverpb::RangeRequest request;
  request.set_key(LeaderKey());
  absl::StatusOr<etcdserverpb::RangeResponse> response =
      client_->Range(request);
  if (!response.ok()) return response.status();
  if (response->kvs_size() == 0) return std::string();
  return response->kvs(0).value();
}

absl::Status EtcdStore::Campaign(
    const std::string& identity, const std::function<bool()>& stop,
    const std::function<void(const std::string&)>& on_standby,
    absl::Duration give_up) {
  StopRenewing();  // a previous term's renewer, if any
  absl::Time last_contact = absl::Now();
  std::string seen;
  absl::Status last_error;
  bool first = true;
  while (true) {
    if (!first) {
      absl::SleepFor(options_.poll_interval);
    }
    first = false;
    if (stop()) return absl::CancelledError("stopped while standing by");
    if (absl::Now() - last_contact > give_up) {
      return absl::UnavailableError(
          absl::StrCat("cannot reach etcd: ", last_error.message()));
    }
    absl::StatusOr<std::string> leader = Leader();
    if (!leader.ok()) {
      last_error = leader.status();
      continue;
    }
    last_contact = absl::Now();
    if (!leader->empty()) {
      if (*leader != seen && on_standby) on_standby(*leader);
      seen = *leader;
      continue;
    }
    // No leader: try to become it. The lease's TTL runs from the grant.
    const absl::Time granted_at = absl::Now();
    absl::StatusOr<etcdserverpb::LeaseGrantResponse> lease =
        client_->LeaseGrant(options_.lease_ttl);
    if (!lease.ok()) {
      last_error = lease.status();
      continue;
    }
    etcdserverpb::TxnRequest txn;
    *txn.add_compare() = CreatedAt(LeaderKey(), 0);
    *txn.add_success() = PutOp(LeaderKey(), identity, lease->id());
    absl::StatusOr<etcdserverpb::TxnResponse> won = client_->Txn(txn);
    if (!won.ok() || !won->succeeded()) {
      if (!won.ok()) last_error = won.status();
      (void)client_->LeaseRevoke(lease->id());  // best effort; else expires
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      leading_ = true;
      lost_.clear();
      lease_id_ = lease->id();
      // The transaction's revision is the leader key's create_revision.
      leader_revision_ = won->header().revision();
      stop_renewing_ = false;
    }
    renewer_ = std::thread(
        [this, id = lease->id(), granted_at] { RenewLoop(id, granted_at); });
    spdlog::info("leading (etcd lease {:x}, revision {})", lease->id(),
                 won->header().revision());
    return absl::OkStatus();
  }
}

void EtcdStore::RenewLoop(int64_t lease_id, absl::Time granted_at) {
  const absl::Duration ttl = absl::Seconds(options_.lease_ttl);
  const absl::Duration interval = ttl / 4;
  const absl::Duration step_down = ttl * 2 / 3;
  // etcd expires the lease no sooner than TTL after it received the last
  // renewal, which is after we sent it: leadership surely holds until
  // last_ok + TTL; we give it up at last_ok + 2/3 TTL. No renewal may run
  // past that point.
  absl::Time last_ok = granted_at;
  absl::Time next = granted_at + interval;
  std::string last_error = "no renewal answered";
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    const absl::Time give_up = last_ok + step_down;
    if (cv_.wait_for(
            lock,
            absl::ToChronoNanoseconds(std::min(next, give_up) - absl::Now()),
            [this] { return stop_renewing_ || !leading_; })) {
      return;
    }
    if (absl::Now() >= give_up) {
      lock.unlock();
      Lose(absl::StrCat("could not renew the etcd lease for ",
                        absl::FormatDuration(absl::Now() - last_ok), ": ",
                        last_error));
      return;
    }
    lock.unlock();
    const absl::Time sent = absl::Now();
    absl::StatusOr<int64_t> remaining =
        client_->LeaseKeepAlive(lease_id, give_up);
    lock.lock();
    if (stop_renewing_ || !leading_) return;
    if (remaining.ok() && *remaining <= 0) {
      lock.unlock();
      Lose("the etcd lease expired");
      return;
    }
    if (remaining.ok()) {
      last_ok = sent;
      next = sent + interval;
    } else {
      last_error = std::string(remaining.status().message());
      // Retry soon, but not in a busy loop against a refusing endpoint.
      next = std::max(sent + interval / 4, absl::Now());
    }
  }
}

void EtcdStore::Lose(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!leading_) return;
    leading_ = false;
    lost_ = why;
  }
  spdlog::warn("lost leadership: {}", why);
  cv_.notify_all();
}

void EtcdStore::StopRenewing() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_renewing_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable() && renewer_.get_id() != std::this_thread::get_id()) {
    renewer_.join();
  }
}

bool EtcdStore::leading() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leading_;
}

std::string EtcdStore::WaitLost(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
               [this] { return !leading_; });
  return leading_ ? std::string() : lost_;
}

void EtcdStore::Resign() {
  StopRenewing();
  int64_t lease = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (leading_) lost_ = "resigned";
    leading_ = false;
    lease = lease_id_;
    lease_id_ = 0;
  }
  cv_.notify_all();
  if (lease != 0) {
    absl::Status s = client_->LeaseRevoke(lease);
    if (!s.ok()) {
      spdlog::warn("could not revoke the etcd lease (it expires by itself): {}",
                   s.ToString());
    }
  }
}

absl::Status EtcdStore::Save(const v1::JobRecord& record) {
  int64_t revision = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!leading_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this coordinator does not lead",
          lost_.empty() ? std::string() : absl::StrCat(" (", lost_, ")")));
    }
    revision = leader_revision_;
  }
  std::string data;
  if (!record.SerializeToString(&data)) {
    return absl::InternalError("cannot serialize a job record");
  }
  etcdserverpb::TxnRequest txn;
  *txn.add_compare() = CreatedAt(LeaderKey(), revision);
  *txn.add_success() = PutOp(JobsPrefix() + record.spec().job_id(), data, 0);
  absl::StatusOr<etcdserverpb::TxnResponse> response = client_->Txn(txn);
  if (!response.ok()) return response.status();
  if (!response->succeeded()) {
    Lose("another coordinator leads now (the leader key changed)");
    return absl::FailedPreconditionError(
        "this coordinator no longer leads: the job was not saved");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::JobRecord>> EtcdStore::LoadAll() {
  const std::string prefix = JobsPrefix();
  std::vector<v1::JobRecord> records;
  std::string from = prefix;
  while (true) {
    etcdserverpb::RangeRequest request;
    request.set_key(from);
    request.set_range_end(EtcdPrefixEnd(prefix));
    request.set_limit(500);
    absl::StatusOr<etcdserverpb::RangeResponse> response =
        client_->Range(request);
    if (!response.ok()) return response.status();
    for (const etcdserverpb::KeyValue& kv : response->kvs()) {
      v1::JobRecord record;
      if (!record.ParseFromString(kv.value())) {
        return absl::DataLossError(
            absl::StrCat("corrupt job record at etcd key ", kv.key()));
      }
      if (prefix + record.spec().job_id() != kv.key()) {
        return absl::DataLossError(absl::StrCat("job record at etcd key ",
                                                kv.key(), " names job '",
                                                record.spec().job_id(), "'"));
      }
      records.push_back(std::move(record));
    }
    if (!response->more() || response->kvs_size() == 0) break;
    // Keys come sorted: go on after the last one.
    from = response->kvs(response->kvs_size() - 1).key() + std::string(1, '\0');
  }
  return records;
}

}  // namespace concord::coordinator
