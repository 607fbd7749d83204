#include "common/coordinator_channel.h"

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace concord {

std::vector<std::string> SplitCoordinatorAddress(const std::string& address) {
  // A gRPC target with a scheme (ipv4:a,b / dns:/// / unix:) is one target.
  const size_t colon = address.find(':');
  const std::string scheme =
      colon == std::string::npos ? "" : address.substr(0, colon);
  if (scheme == "ipv4" || scheme == "ipv6" || scheme == "dns" ||
      scheme == "unix" || scheme == "unix-abstract") {
    return {address};
  }
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(address, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) out.emplace_back(part);
  }
  if (out.empty()) out.push_back(address);
  return out;
}

std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address,
                                                  const TlsMaterial& tls) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Its own subchannels: a fresh channel must not inherit the backoff
  // state of the one it replaces through gRPC's global subchannel pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, ChannelCredentials(tls), args);
}

}  // namespace concord
