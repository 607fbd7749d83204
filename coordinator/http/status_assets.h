#pragma once
// The status page's files (coordinator/http/status/), embedded at build time by
// cmake/ConcordEmbed.cmake into status_assets.cc.

namespace concord::coordinator {

extern const char kStatusIndexHtml[];
extern const char kStatusAppJs[];
extern const char kStatusAppCss[];

}  // namespace concord::coordinator
