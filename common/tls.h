#pragma once
// TLS material for the coordinator's gRPC port and its clients: PEM files
// read and checked once at startup, turned into gRPC credentials.
//
// Server: a certificate chain and its key; with a client CA the server asks
// every client for a certificate and refuses connections without one that
// the CA signed (mTLS). Clients: the CA that signed the server's
// certificate, and optionally their own certificate and key (for mTLS).
// Tokens are still required on top of TLS: the certificate says "may
// connect", the bearer token says which role.
//
// Files are checked with OpenSSL before gRPC sees them, so that a missing,
// unreadable or malformed file, or a key that does not match its
// certificate, is one clear error (gRPC itself would log several lines and
// fail later).

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace concord {

// Paths of the PEM files; empty means "not given".
struct TlsFiles {
  std::string ca;    // the CA to verify the peer with
  std::string cert;  // own certificate chain
  std::string key;   // own private key
};

// PEM contents, read and checked.
struct TlsMaterial {
  std::string ca_pem;
  std::string cert_pem;
  std::string key_pem;
  bool enabled() const { return !ca_pem.empty() || !cert_pem.empty(); }
};

// Server side: `cert` and `key` are required together; `ca` (optional)
// turns on mTLS. Returns the material with every file read. Errors:
// INVALID_ARGUMENT naming the flag (or variable) and file: unreadable, not
// PEM, a key that does not match the certificate, a key without a
// certificate or the reverse. `names` holds the flags' names for messages,
// e.g. {"--tls-client-ca", "--tls-cert", "--tls-key"}.
absl::StatusOr<TlsMaterial> LoadServerTls(const TlsFiles& files,
                                          const TlsFiles& names);
// Client side: `ca` is required when anything is given; `cert` and `key`
// together (mTLS). All empty = plaintext (returns material with
// enabled() == false). Errors as LoadServerTls.
absl::StatusOr<TlsMaterial> LoadClientTls(const TlsFiles& files,
                                          const TlsFiles& names);

// Credentials for grpc::ServerBuilder::AddListeningPort: insecure when the
// material is empty, TLS with `cert_pem`/`key_pem`, and mTLS (client
// certificate required and verified against `ca_pem`) when `ca_pem` is set.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const TlsMaterial& tls);
// Credentials for grpc::CreateChannel: insecure when the material is empty,
// else TLS verifying the server against `ca_pem`, presenting
// `cert_pem`/`key_pem` when set.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const TlsMaterial& tls);

// What a client tool (concord-run with --coordinator, concordctl) calls the
// coordinator with: the bearer token read from `*token_file` (set from
// CONCORD_TOKEN_FILE when empty) and the TLS material of the --tls-ca,
// --tls-cert and --tls-key files. INVALID_ARGUMENT naming what is missing or
// bad ("--token-file F (or CONCORD_TOKEN_FILE) is required", a file that
// cannot be read, a malformed token or PEM).
struct ClientCredentials {
  std::string token;
  TlsMaterial tls;
};
absl::StatusOr<ClientCredentials> LoadClientCredentials(std::string* token_file,
                                                        const TlsFiles& tls);

}  // namespace concord
