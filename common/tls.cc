#include "common/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/environment.h"

namespace concord {
namespace {

// Files larger than this are not certificates.
constexpr std::streamsize kMaxPemBytes = 1 << 20;

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

absl::Status Bad(const std::string& flag, const std::string& path,
                 const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": ", why));
}

absl::StatusOr<std::string> ReadPem(const std::string& flag,
                                    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Bad(flag, path, std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Bad(flag, path, std::strerror(errno));
  std::string pem = text.str();
  if (static_cast<std::streamsize>(pem.size()) > kMaxPemBytes) {
    return Bad(flag, path, "larger than 1 MiB");
  }
  return pem;
}

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of `pem`; every certificate in it must parse.
absl::StatusOr<X509Ptr> ParseCerts(const std::string& flag,
                                   const std::string& path,
                                   const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr first;
  int count = 0;
  while (true) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) break;
    if (first == nullptr) first = std::move(cert);
    ++count;
  }
  // PEM_read_bio_X509 ends with "no start line" after the last one; any
  // other error means a damaged certificate.
  const unsigned long err = ERR_peek_last_error();
  ERR_clear_error();
  if (count == 0) return Bad(flag, path, "no PEM certificate in it");
  if (err != 0 && ERR_GET_REASON(err) != PEM_R_NO_START_LINE) {
    return Bad(flag, path, "a certificate in it cannot be parsed");
  }
  return first;
}

absl::StatusOr<KeyPtr> ParseKey(const std::string& flag,
                                const std::string& path,
                                const std::string& pem) {
  BioPtr bio = MemBio(pem);
  KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return Bad(flag, path, "no unencrypted PEM private key in it");
  }
  return key;
}

// Reads the files that are set and checks they fit together.
absl::StatusOr<TlsMaterial> Load(const TlsFiles& files, const TlsFiles& names) {
  const std::string& ca_flag = names.ca;
  const std::string& cert_flag = names.cert;
  const std::string& key_flag = names.key;
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(cert_flag, " and ", key_flag, " must be given together"));
  }
  TlsMaterial tls;
  if (!files.ca.empty()) {
    auto pem = ReadPem(ca_flag, files.ca);
    if (!pem.ok()) return pem.status();
    if (auto ca = ParseCerts(ca_flag, files.ca, *pem); !ca.ok()) {
      return ca.status();
    }
    tls.ca_pem = *std::move(pem);
  }
  if (!files.cert.empty()) {
    auto cert_pem = ReadPem(cert_flag, files.cert);
    if (!cert_pem.ok()) return cert_pem.status();
    auto cert = ParseCerts(cert_flag, files.cert, *cert_pem);
    if (!cert.ok()) return cert.status();
    auto key_pem = ReadPem(key_flag, files.key);
    if (!key_pem.ok()) return key_pem.status();
    auto key = ParseKey(key_flag, files.key, *key_pem);
    if (!key.ok()) return key.status();
    const int match = X509_check_private_key(cert->get(), key->get());
    ERR_clear_error();
    if (match != 1) {
      return Bad(
          key_flag, files.key,
          absl::StrCat("does not match the certificate in ", files.cert));
    }
    tls.cert_pem = *std::move(cert_pem);
    tls.key_pem = *std::move(key_pem);
  }
  return tls;
}

}  // namespace

absl::StatusOr<TlsMaterial> LoadServerTls(const TlsFiles& files,
                                          const TlsFiles& names) {
  if (files.cert.empty() && files.key.empty()) {
    if (!files.ca.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(names.ca, " needs ", names.cert, " and ", names.key));
    }
    return TlsMaterial{};
  }
  return Load(files, names);
}

absl::StatusOr<TlsMaterial> LoadClientTls(const TlsFiles& files,
                                          const TlsFiles& names) {
  if (files.ca.empty()) {
    if (!files.cert.empty() || !files.key.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(names.cert, " and ", names.key, " need ", names.ca,
                       " (the CA that signed the coordinator's certificate)"));
    }
    return TlsMaterial{};
  }
  return Load(files, names);
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const TlsMaterial& tls) {
  if (tls.cert_pem.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls.ca_pem.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const TlsMaterial& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.ca_pem;
  options.pem_private_key = tls.key_pem;
  options.pem_cert_chain = tls.cert_pem;
  return grpc::SslCredentials(options);
}

absl::StatusOr<ClientCredentials> LoadClientCredentials(std::string* token_file,
                                                        const TlsFiles& tls) {
  if (token_file->empty()) *token_file = env::Get(env::kTokenFile);
  if (token_file->empty()) {
    return absl::InvalidArgumentError(
        "--token-file F (or CONCORD_TOKEN_FILE) is required");
  }
  ClientCredentials out;
  auto token = ReadTokenFile(*token_file);
  if (!token.ok()) return token.status();
  out.token = *std::move(token);
  auto material = LoadClientTls(tls, {"--tls-ca", "--tls-cert", "--tls-key"});
  if (!material.ok()) return material.status();
  out.tls = *std::move(material);
  return out;
}

}  // namespace concord
