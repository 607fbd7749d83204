#include "agent/process_view.h"

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace concord::agent {

std::optional<ProcStat> ParseProcStat(absl::string_view line) {
  const size_t close = line.rfind(')');
  if (close == absl::string_view::npos || line.find('(') > close) {
    return std::nullopt;
  }
  // After "pid (comm)": state is field 3; utime, stime and starttime are
  // fields 14, 15 and 22 (proc(5)).
  const std::vector<absl::string_view> f =
      absl::StrSplit(line.substr(close + 1), ' ', absl::SkipEmpty());
  if (f.size() < 20 || f[0].size() != 1) return std::nullopt;
  ProcStat s;
  s.state = f[0][0];
  int64_t utime = 0, stime = 0;
  if (!absl::SimpleAtoi(f[11], &utime) || !absl::SimpleAtoi(f[12], &stime) ||
      !absl::SimpleAtoi(f[19], &s.start_time) || utime < 0 || stime < 0) {
    return std::nullopt;
  }
  s.cpu_ticks = utime + stime;
  return s;
}

std::string StateName(char state) {
  switch (state) {
    case 'R':
      return "running";
    case 'S':
    case 'I':
      return "sleeping";
    case 'D':
      return "disk";
    case 'T':
    case 't':
      return "stopped";
    case 'Z':
    case 'X':
      return "zombie";
    default:
      return "";
  }
}

namespace {

std::optional<ProcStat> ReadStat(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return ParseProcStat(line);
}

// Whether a thread of process `pid` is in uninterruptible sleep.
bool AThreadInDisk(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return false;
  bool disk = false;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::optional<ProcStat> s =
        ReadStat(absl::StrCat(dir, "/", e->d_name, "/stat"));
    if (s.has_value() && s->state == 'D') {
      disk = true;
      break;
    }
  }
  closedir(d);
  return disk;
}

}  // namespace

// NVML's C interface, the part used here, as nvml.h declares it (the
// driver's library keeps these symbols and layouts stable across versions).
struct GpuActivity::Nvml {
  using Device = struct nvmlDevice_st*;
  struct Sample {
    unsigned int pid;
    unsigned long long time_stamp;  // microseconds
    unsigned int sm_util;
    unsigned int mem_util;
    unsigned int enc_util;
    unsigned int dec_util;
  };
  static constexpr int kSuccess = 0;
  static constexpr int kNotFound = 6;
  static constexpr int kInsufficientSize = 7;

  void* library = nullptr;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*count)(unsigned int*) = nullptr;
  int (*handle)(unsigned int, Device*) = nullptr;
  int (*utilization)(Device, Sample*, unsigned int*,
                     unsigned long long) = nullptr;
  std::vector<Device> devices;
  std::vector<unsigned long long> last_seen;  // per device

  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

GpuActivity::GpuActivity(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}
GpuActivity::~GpuActivity() = default;

std::unique_ptr<GpuActivity> GpuActivity::Open(std::string* why) {
  auto fail = [&](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return nullptr;
  };
  auto nvml = std::make_unique<Nvml>();
  nvml->library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->library == nullptr) {
    return fail(absl::StrCat("no NVML (", dlerror(), ")"));
  }
  auto sym = [&](const char* name) { return dlsym(nvml->library, name); };
  auto* init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
  nvml->count =
      reinterpret_cast<int (*)(unsigned int*)>(sym("nvmlDeviceGetCount_v2"));
  nvml->handle = reinterpret_cast<int (*)(unsigned int, Nvml::Device*)>(
      sym("nvmlDeviceGetHandleByIndex_v2"));
  nvml->utilization = reinterpret_cast<int (*)(
      Nvml::Device, Nvml::Sample*, unsigned int*, unsigned long long)>(
      sym("nvmlDeviceGetProcessUtilization"));
  auto* shutdown = reinterpret_cast<int (*)()>(sym("nvmlShutdown"));
  if (init == nullptr || shutdown == nullptr || nvml->count == nullptr ||
      nvml->handle == nullptr || nvml->utilization == nullptr) {
    return fail("NVML lacks the functions the agent uses");
  }
  if (int r = init(); r != Nvml::kSuccess) {
    return fail(absl::StrCat("NVML did not initialise (error ", r, ")"));
  }
  nvml->shutdown = shutdown;
  unsigned int n = 0;
  if (nvml->count(&n) != Nvml::kSuccess || n == 0) return fail("no GPU");
  for (unsigned int i = 0; i < n; ++i) {
    Nvml::Device d = nullptr;
    if (nvml->handle(i, &d) == Nvml::kSuccess) nvml->devices.push_back(d);
  }
  if (nvml->devices.empty()) return fail("no GPU NVML can read");
  nvml->last_seen.assign(nvml->devices.size(), 0);
  return std::unique_ptr<GpuActivity>(new GpuActivity(std::move(nvml)));
}

std::map<pid_t, int> GpuActivity::Sample() {
  std::map<pid_t, int> out;
  std::vector<Nvml::Sample> samples;
  for (size_t i = 0; i < nvml_->devices.size(); ++i) {
    unsigned int n = 0;
    int r =
        nvml_->utilization(nvml_->devices[i], nullptr, &n, nvml_->last_seen[i]);
    if (r == Nvml::kNotFound || n == 0) continue;  // nothing since then
    if (r != Nvml::kInsufficientSize && r != Nvml::kSuccess) continue;
    samples.resize(n);
    r = nvml_->utilization(nvml_->devices[i], samples.data(), &n,
                           nvml_->last_seen[i]);
    if (r != Nvml::kSuccess) continue;
    for (unsigned int k = 0; k < n && k < samples.size(); ++k) {
      const Nvml::Sample& s = samples[k];
      int& percent = out[static_cast<pid_t>(s.pid)];
      percent = std::max(percent, static_cast<int>(std::min(s.sm_util, 100u)));
      nvml_->last_seen[i] = std::max(nvml_->last_seen[i], s.time_stamp);
    }
  }
  return out;
}

ProcessWatch::ProcessWatch(std::unique_ptr<GpuActivity> gpu)
    : gpu_(std::move(gpu)) {
  const long ticks = sysconf(_SC_CLK_TCK);
  if (ticks > 0) ticks_per_second_ = ticks;
}

void ProcessWatch::RefreshGpu(absl::Duration every) {
  if (gpu_ == nullptr) return;
  const absl::Time now = absl::Now();
  if (now - gpu_sampled_ < every) return;
  gpu_sampled_ = now;
  gpu_percent_ = gpu_->Sample();
}

std::optional<v1::ProcessView> ProcessWatch::View(int64_t pid) {
  if (pid <= 1 || pid > INT32_MAX) return std::nullopt;
  const pid_t p = static_cast<pid_t>(pid);
  std::optional<ProcStat> s = ReadStat(absl::StrCat("/proc/", p, "/stat"));
  if (!s.has_value()) {
    known_.erase(p);
    return std::nullopt;
  }
  auto [it, first] = known_.emplace(p, s->start_time);
  if (!first && it->second != s->start_time) return std::nullopt;
  v1::ProcessView v;
  std::string state = StateName(s->state);
  if (state == "sleeping" && AThreadInDisk(p)) state = "disk";
  v.set_state(std::move(state));
  v.set_cpu_ms(s->cpu_ticks * 1000 / ticks_per_second_);
  if (gpu_ != nullptr) {
    auto g = gpu_percent_.find(p);
    v.set_gpu_percent(g == gpu_percent_.end() ? 0 : g->second);
  }
  return v;
}

}  // namespace concord::agent
