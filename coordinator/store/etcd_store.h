#pragma once
// The etcd Store, for coordinators that must outlive their machine: several
// replicas share one etcd cluster; one of them leads (serves workers and
// operators), the others stand by and take over when it goes.
//
// Thread-safety: every method may be called from any thread.

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/store/etcd_client.h"
#include "coordinator/store/store.h"

namespace concord::coordinator {

struct EtcdStoreOptions {
  std::string prefix = "/concord/";
  // Seconds; etcd's minimum is about 2.
  int64_t lease_ttl = 5;
  // How often a standby looks at the leader key.
  absl::Duration poll_interval = absl::Milliseconds(250);
};

// Note [etcd leadership]
// ~~~~~~~~~~~~~~~~~~~~~~
// Keys under a prefix P (default "/concord/"):
//   P + "leader"         the leader's identity, attached to its lease
//   P + "jobs/" + JOB    the job's JobRecord (protobuf binary)
// Campaign grants a lease of `lease_ttl` and puts the leader key with it in a
// transaction that succeeds only if the key does not exist (create_revision
// 0); the losers poll the key until it disappears, which happens when the
// leader revokes its lease (clean shutdown: the standby takes over at once)
// or the lease expires (the leader died or lost etcd: after at most the
// TTL). The leader renews its lease every TTL/4 and gives leadership up
// itself when no renewal succeeded for 2/3 of the TTL, before etcd could
// expire the lease and elect another — so two leaders never serve at once
// unless clocks run at very different rates.
//
// Every Save is fenced: a transaction that writes the record only if the
// leader key still has the create_revision this replica's campaign created.
// A deposed leader therefore cannot overwrite what its successor wrote, even
// if it has not yet noticed; its Save fails with FAILED_PRECONDITION and
// leadership is reported lost. A new leader loads every job (LoadAll), so a
// failover loses nothing that was saved — and a job change is saved before
// the call that made it is answered (see Note [Persistence] in core.h).

class EtcdStore final : public Store {
 public:
  // Errors: INVALID_ARGUMENT (empty prefix, lease_ttl < 1).
  static absl::StatusOr<std::unique_ptr<EtcdStore>> Create(
      std::unique_ptr<EtcdClient> client, EtcdStoreOptions options);
  // Stops renewing; does not revoke (call Resign for that).
  ~EtcdStore() override;
  EtcdStore(const EtcdStore&) = delete;
  EtcdStore& operator=(const EtcdStore&) = delete;

  // Blocks until this replica leads, with `identity` (e.g. host, pid and
  // address; shown to standbys and operators) as the leader key's value.
  // `on_standby(leader)` is called once whenever the leader seen changes
  // while waiting. Returns CANCELLED once `stop()` is true (checked every
  // poll), or UNAVAILABLE when etcd cannot be reached for `give_up`.
  absl::Status Campaign(
      const std::string& identity, const std::function<bool()>& stop,
      const std::function<void(const std::string&)>& on_standby,
      absl::Duration give_up = absl::InfiniteDuration());
  // Whether this replica still leads (it may have lost the lease since).
  bool leading() const;
  // Waits until leadership is lost or `timeout` passes; returns why it was
  // lost, or "" if it was not.
  std::string WaitLost(absl::Duration timeout);
  // Gives leadership up: stops renewing and revokes the lease, which
  // deletes the leader key (a standby takes over at its next poll).
  void Resign();

  // The leader key's current value; "" when there is no leader.
  // Errors: UNAVAILABLE.
  absl::StatusOr<std::string> Leader();

  // Store. Save: FAILED_PRECONDITION when this replica does not lead
  // (anymore), UNAVAILABLE when etcd cannot be reached. LoadAll: DATA_LOSS
  // for a record that cannot be parsed or is under the wrong key.
  absl::Status Save(const v1::JobRecord& record) override;
  absl::StatusOr<std::vector<v1::JobRecord>> LoadAll() override;

 private:
  EtcdStore(std::unique_ptr<EtcdClient> client, EtcdStoreOptions options)
      : client_(std::move(client)), options_(std::move(options)) {}
  std::string LeaderKey() const { return options_.prefix + "leader"; }
  std::string JobsPrefix() const { return options_.prefix + "jobs/"; }
  // Renews the lease until told to stop or the lease is lost; its TTL runs
  // from `granted_at` (when the grant was asked for).
  void RenewLoop(int64_t lease_id, absl::Time granted_at);
  void StopRenewing();
  void Lose(const std::string& why);

  std::unique_ptr<EtcdClient> client_;
  const EtcdStoreOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool leading_ = false;
  std::string lost_;             // why leadership was lost, if it was
  int64_t lease_id_ = 0;         // while leading
  int64_t leader_revision_ = 0;  // create_revision of our leader key
  bool stop_renewing_ = false;
  std::thread renewer_;
};

}  // namespace concord::coordinator
