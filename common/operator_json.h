#pragma once
// The JSON forms of the operator views (operator.proto), shared by
// `concordctl -o json` and the coordinator's status page (/api/...), so that
// both print the same field names. docs/operators.md documents them as
// stable: fields are only ever added, never renamed or given another meaning.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "concord/v1/operator.pb.h"

namespace concord {

using OrderedJson = nlohmann::ordered_json;

// "RUNNING" for JOB_STATE_RUNNING.
std::string JobStateName(v1::JobState state);
// RFC 3339 UTC with milliseconds: "2024-05-01T12:00:00.123Z".
std::string FormatUnixMs(int64_t unix_ms);

OrderedJson EventJson(const v1::Event& e);
OrderedJson MemberJson(const v1::MemberStatus& m);
OrderedJson SummaryJson(const v1::JobSummary& s);
OrderedJson CheckpointJson(const v1::CheckpointReport& c);
OrderedJson CheckpointTotalsJson(const v1::CheckpointTotals& t);
OrderedJson StatusJson(const v1::JobStatus& s);

}  // namespace concord
