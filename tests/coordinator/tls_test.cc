// TLS and mTLS through the real gRPC server on loopback, with a CA, server
// and client certificates made by the openssl command at test time: TLS
// works; a plaintext client, a client that does not trust the server, and
// (with a client CA) a client without a certificate or with one from
// another CA are refused and change nothing; the binaries take the flags
// and turn bad or missing files into one line and exit status 2.

#include "common/tls.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "agent/node_agent.h"
#include "tests/coordinator/test_util.h"
#include "worker/coordinator_client.h"

namespace concord::coordinator {
namespace {

using namespace ::concord::coordinator::testing;  // NOLINT
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kBin = CONCORD_BIN_DIR;
const TlsFiles kServerNames{"--tls-client-ca", "--tls-cert", "--tls-key"};
const TlsFiles kClientNames{"--tls-ca", "--tls-cert", "--tls-key"};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int Shell(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// A CA, a server certificate for 127.0.0.1/localhost, a client certificate
// from that CA, and a second CA with a client certificate of its own.
class Certificates {
 public:
  Certificates() {
    char tmpl[] = "/tmp/concord-tls-test-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
    std::vector<std::string> steps = {
        CaCommands("ca", ec),
        CaCommands("rogue", ec),
        SignedCommands("server", "ca", ec,
                       "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        SignedCommands("client", "ca", ec, "extendedKeyUsage=clientAuth"),
        SignedCommands("rogue-client", "rogue", ec,
                       "extendedKeyUsage=clientAuth"),
    };
    ok_ =
        Shell(absl::StrCat("cd '", dir_, "' && (", absl::StrJoin(steps, " && "),
                           ") > openssl.log 2>&1")) == 0;
  }
  ~Certificates() {
    if (!dir_.empty()) (void)Shell("rm -rf '" + dir_ + "'");
  }

  bool ok() const { return ok_; }
  std::string log() const { return ReadFile(dir_ + "/openssl.log"); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  static std::string CaCommands(const std::string& name,
                                const std::string& ec) {
    return absl::StrCat("openssl req -x509 ", ec,
                        " -nodes -days 2 -subj /CN=", name, "-ca -keyout ",
                        name, ".key -out ", name, ".pem");
  }
  static std::string SignedCommands(const std::string& name,
                                    const std::string& ca,
                                    const std::string& ec,
                                    const std::string& extension) {
    return absl::StrCat(
        "openssl req ", ec, " -nodes -subj /CN=", name, " -keyout ", name,
        ".key -out ", name, ".csr && echo '", extension, "' > ", name,
        ".ext && openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ",
        ca, ".key -CAcreateserial -days 2 -extfile ", name, ".ext -out ", name,
        ".pem");
  }

  std::string dir_;
  bool ok_ = false;
};

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    spdlog::set_level(spdlog::level::warn);
    certs_ = new Certificates();
  }
  static void TearDownTestSuite() {
    delete certs_;
    certs_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(certs_->ok()) << "openssl failed:\n" << certs_->log();
  }

  static std::string P(const std::string& name) { return certs_->Path(name); }

  // A server with TLS, and mTLS when `client_ca` is given.
  std::unique_ptr<Server> StartServer(const std::string& client_ca = "") {
    auto tls = LoadServerTls({client_ca, P("server.pem"), P("server.key")},
                             kServerNames);
    EXPECT_TRUE(tls.ok()) << tls.status();
    ServerOptions options = Options();
    options.tls = *tls;
    auto server = Server::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  static TlsMaterial Client(const TlsFiles& files) {
    auto tls = LoadClientTls(files, kClientNames);
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : TlsMaterial{};
  }

  // ListJobs over a channel with `credentials`: the code of the call.
  static grpc::StatusCode ListJobs(
      const std::string& address,
      std::shared_ptr<grpc::ChannelCredentials> credentials) {
    auto stub = v1::OperatorService::NewStub(
        grpc::CreateChannel(address, std::move(credentials)));
    v1::ListJobsResponse r;
    auto context = Ctx(kOperatorToken);
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(5));
    return stub->ListJobs(context.get(), {}, &r).error_code();
  }

  // A worker's Join (as the Session makes it) with `tls`.
  static absl::Status WorkerJoin(const std::string& address,
                                 const std::string& worker,
                                 const TlsMaterial& tls) {
    worker::CoordinatorClient client(
        address,
        worker::ClientIdentity{kWorkerToken, worker, Secret(worker), tls});
    v1::JoinRequest request = JoinReq("tls-job", 1, 1, worker);
    return client.Join(request, absl::Seconds(3)).status();
  }

  static Certificates* certs_;
};

Certificates* TlsTest::certs_ = nullptr;

TEST_F(TlsTest, TlsServesTlsClientsAndRefusesPlaintextAndUntrusted) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  const TlsMaterial tls = Client({P("ca.pem"), "", ""});

  EXPECT_EQ(ListJobs(address, ChannelCredentials(tls)), grpc::StatusCode::OK);
  EXPECT_TRUE(WorkerJoin(address, "w0", tls).ok());
  // A client certificate the server did not ask for does no harm.
  EXPECT_EQ(
      ListJobs(address, ChannelCredentials(Client(
                            {P("ca.pem"), P("client.pem"), P("client.key")}))),
      grpc::StatusCode::OK);

  // Plaintext, and TLS trusting another CA: the handshake fails, nothing is
  // served and nothing changes.
  EXPECT_EQ(ListJobs(address, grpc::InsecureChannelCredentials()),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(
      ListJobs(address, ChannelCredentials(Client({P("rogue.pem"), "", ""}))),
      grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(WorkerJoin(address, "w1", TlsMaterial{}).code(),
            absl::StatusCode::kUnavailable);
  auto status =
      server->host().Read([](const Core& core) { return core.ListJobs(); });
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).world_size(), 1);  // w0 only; w1 never arrived
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  auto server = StartServer(P("ca.pem"));
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  const TlsMaterial with_cert =
      Client({P("ca.pem"), P("client.pem"), P("client.key")});

  EXPECT_EQ(ListJobs(address, ChannelCredentials(with_cert)),
            grpc::StatusCode::OK);
  EXPECT_TRUE(WorkerJoin(address, "w0", with_cert).ok());

  // No certificate, a certificate from another CA, plaintext: refused.
  EXPECT_EQ(
      ListJobs(address, ChannelCredentials(Client({P("ca.pem"), "", ""}))),
      grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ListJobs(address, ChannelCredentials(
                                  Client({P("ca.pem"), P("rogue-client.pem"),
                                          P("rogue-client.key")}))),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ListJobs(address, grpc::InsecureChannelCredentials()),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(WorkerJoin(address, "w1", Client({P("ca.pem"), "", ""})).code(),
            absl::StatusCode::kUnavailable);
  auto jobs =
      server->host().Read([](const Core& core) { return core.ListJobs(); });
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).world_size(), 1);

  // A certificate opens the connection; the token still decides the role.
  auto stub = v1::OperatorService::NewStub(
      grpc::CreateChannel(address, ChannelCredentials(with_cert)));
  v1::ListJobsResponse r;
  EXPECT_EQ(stub->ListJobs(Ctx(kWorkerToken).get(), {}, &r).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(stub->ListJobs(Ctx("").get(), {}, &r).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// A node agent speaks mTLS to the coordinator for its workers, which reach
// it in plaintext on its local socket; an agent without the client
// certificate reaches nothing.
TEST_F(TlsTest, ANodeAgentCarriesItsWorkersOverMutualTls) {
  auto server = StartServer(P("ca.pem"));
  ASSERT_NE(server, nullptr);
  const std::string socket = P("agent.sock");
  auto start_agent = [&](const TlsMaterial& tls) {
    agent::NodeAgentOptions o;
    o.coordinator = server->address();
    o.token = kWorkerToken;
    o.tls = tls;
    o.listen = "unix:" + socket;
    auto agent = agent::NodeAgent::Start(o);
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? *std::move(agent) : nullptr;
  };
  {
    auto agent =
        start_agent(Client({P("ca.pem"), P("client.pem"), P("client.key")}));
    ASSERT_NE(agent, nullptr);
    EXPECT_TRUE(WorkerJoin(agent->address(), "w0", TlsMaterial{}).ok());
  }
  unlink(socket.c_str());
  {
    auto agent = start_agent(Client({P("ca.pem"), "", ""}));
    ASSERT_NE(agent, nullptr);
    EXPECT_EQ(WorkerJoin(agent->address(), "w1", TlsMaterial{}).code(),
              absl::StatusCode::kUnavailable);
  }
  unlink(socket.c_str());
  auto jobs =
      server->host().Read([](const Core& core) { return core.ListJobs(); });
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).world_size(), 1);  // w0 only
}

TEST_F(TlsTest, BadFilesAreInvalidArgumentNamingFlagAndFile) {
  const std::string missing = P("missing.pem");
  const std::string not_pem = P("server.ext");
  struct Case {
    TlsFiles files;
    bool server;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"", missing, P("server.key")}, true, "--tls-cert " + missing},
      {{"", P("server.pem"), missing}, true, "--tls-key " + missing},
      {{"", not_pem, P("server.key")}, true, "no PEM certificate"},
      {{"", P("server.pem"), not_pem}, true, "no unencrypted PEM private key"},
      {{"", P("server.pem"), P("client.key")}, true, "does not match"},
      {{"", P("server.pem"), ""}, true, "must be given together"},
      {{P("ca.pem"), "", ""}, true, "--tls-client-ca needs --tls-cert"},
      {{missing, P("server.pem"), P("server.key")},
       true,
       "--tls-client-ca " + missing},
      {{not_pem, "", ""}, false, "--tls-ca " + not_pem},
      {{"", P("client.pem"), P("client.key")}, false, "need --tls-ca"},
      {{P("ca.pem"), P("client.pem"), P("server.key")},
       false,
       "does not match"},
  };
  for (const Case& c : cases) {
    auto tls = c.server ? LoadServerTls(c.files, kServerNames)
                        : LoadClientTls(c.files, kClientNames);
    EXPECT_EQ(tls.status().code(), absl::StatusCode::kInvalidArgument)
        << c.expect;
    EXPECT_THAT(std::string(tls.status().message()), HasSubstr(c.expect));
    EXPECT_THAT(std::string(tls.status().message()), Not(HasSubstr("\n")));
  }
  EXPECT_FALSE(LoadClientTls({}, kClientNames)->enabled());
}

// The binaries: flags, one-line errors with exit status 2, and concordctl
// against a TLS concord-coordinator.
class TlsProcessTest : public TlsTest {
 protected:
  void SetUp() override {
    TlsTest::SetUp();
    char tmpl[] = "/tmp/concord-tls-process-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_TRUE(WriteTokenFile(dir_ + "/worker", kWorkerToken).ok());
    ASSERT_TRUE(WriteTokenFile(dir_ + "/operator", kOperatorToken).ok());
  }
  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (!dir_.empty()) (void)Shell("rm -rf '" + dir_ + "'");
  }

  // Runs `args` (bounded by timeout(1)); exit status, stdout and stderr.
  struct Result {
    int exit_status;
    std::string out, err;
  };
  Result Run(const std::string& args) {
    const int code = Shell(absl::StrCat("timeout -s KILL 30 ", args, " > '",
                                        dir_, "/out' 2> '", dir_, "/err'"));
    return {code, ReadFile(dir_ + "/out"), ReadFile(dir_ + "/err")};
  }

  std::string Coordinator(const std::string& tls_flags) {
    return absl::StrCat(kBin, "/concord-coordinator --listen 127.0.0.1:0 ",
                        "--worker-token-file ", dir_, "/worker ",
                        "--operator-token-file ", dir_, "/operator ",
                        tls_flags);
  }

  // Starts the coordinator in the background; its address, or "".
  std::string StartCoordinator(const std::string& tls_flags) {
    const std::string log = dir_ + "/coordinator.log";
    pid_ = fork();
    if (pid_ == 0) {
      const std::string command =
          "exec " + Coordinator(tls_flags) + " 2> '" + log + "'";
      execl("/bin/sh", "sh", "-c", command.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      const std::string text = ReadFile(log);
      const size_t at = text.find("listening on ");
      const size_t eol = at == std::string::npos ? at : text.find('\n', at);
      if (eol != std::string::npos) return text.substr(at + 13, eol - at - 13);
      absl::SleepFor(absl::Milliseconds(50));
    }
    ADD_FAILURE() << "coordinator did not start: " << ReadFile(log);
    return "";
  }

  std::string dir_;
  pid_t pid_ = -1;
};

TEST_F(TlsProcessTest, CoordinatorRefusesBadTlsFilesWithOneLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--tls-cert " + P("nope.pem") + " --tls-key " + P("server.key"),
       "--tls-cert " + P("nope.pem")},
      {"--tls-cert " + P("server.pem") + " --tls-key " + P("client.key"),
       "does not match"},
      {"--tls-cert " + P("server.pem"), "must be given together"},
      {"--tls-client-ca " + P("ca.pem"), "--tls-client-ca needs"},
      {"--tls-cert " + P("server.pem") + " --tls-key " + P("server.key") +
           " --tls-client-ca " + P("server.ext"),
       "--tls-client-ca"},
  };
  for (const auto& [flags, expect] : cases) {
    const Result r = Run(Coordinator(flags));
    EXPECT_EQ(r.exit_status, 2) << flags << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(expect));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST_F(TlsProcessTest, ConcordctlAndConcordRunOverMutualTls) {
  const std::string address =
      StartCoordinator("--tls-cert " + P("server.pem") + " --tls-key " +
                       P("server.key") + " --tls-client-ca " + P("ca.pem"));
  ASSERT_FALSE(address.empty());
  const std::string ctl =
      absl::StrCat(kBin, "/concordctl --endpoint ", address, " --token-file ",
                   dir_, "/operator ", "--timeout-ms 5000 ");
  const std::string client_flags = " --tls-ca " + P("ca.pem") + " --tls-cert " +
                                   P("client.pem") + " --tls-key " +
                                   P("client.key");

  Result r = Run(ctl + "jobs -o json" + client_flags);
  EXPECT_EQ(r.exit_status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"jobs\""));

  // Without a client certificate, or without TLS: unreachable (exit 1).
  r = Run(ctl + "jobs --tls-ca " + P("ca.pem"));
  EXPECT_EQ(r.exit_status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  r = Run(ctl + "jobs");
  EXPECT_EQ(r.exit_status, 1) << r.err;

  // Bad files: one line, exit 2, before any call.
  r = Run(ctl + "jobs --tls-ca " + P("nope.pem"));
  EXPECT_EQ(r.exit_status, 2);
  EXPECT_THAT(r.err, HasSubstr("--tls-ca " + P("nope.pem")));
  r = Run(ctl + "jobs --tls-cert " + P("client.pem"));
  EXPECT_EQ(r.exit_status, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;

  // concord-run checks the files before starting any worker.
  const std::string run =
      absl::StrCat(kBin, "/concord-run --coordinator ", address,
                   " --token-file ", dir_, "/worker --nproc 1 ");
  r = Run(run + "--tls-ca " + P("nope.pem") + " -- /bin/true");
  EXPECT_EQ(r.exit_status, 2);
  EXPECT_THAT(r.err, HasSubstr("--tls-ca " + P("nope.pem")));
  r = Run(run + "--tls-ca " + P("ca.pem") + " --tls-cert " + P("client.pem") +
          " --tls-key " + P("server.key") + " -- /bin/true");
  EXPECT_EQ(r.exit_status, 2);
  EXPECT_THAT(r.err, HasSubstr("does not match"));
  // As their node agent it speaks TLS for its workers, which dial its
  // local socket and get no TLS files ...
  r = Run(run + client_flags.substr(1) +
          " -- /bin/sh -c 'echo [$CONCORD_COORDINATOR] [$CONCORD_TLS_CA] >&2'");
  EXPECT_EQ(r.exit_status, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("[unix:/tmp/concord-agent-"));
  EXPECT_THAT(r.err, HasSubstr("[]"));
  // ... and with --no-agent hands them to its workers.
  r = Run(run + client_flags.substr(1) +
          " --no-agent -- /bin/sh -c 'echo $CONCORD_TLS_CA $CONCORD_TLS_CERT "
          "$CONCORD_TLS_KEY >&2'");
  EXPECT_EQ(r.exit_status, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr(P("ca.pem") + " " + P("client.pem") + " " +
                               P("client.key")));
}

}  // namespace
}  // namespace concord::coordinator
