// The workers' output under concord-run (see Note [Worker output] in
// launcher.h): pipes and pseudo-terminals, prefixed lines, log files.

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tools/launcher.h"

namespace concord::launcher {
namespace {

constexpr size_t kMaxLine = 64 << 10;  // longer lines go out in pieces
constexpr size_t kTailLines = 20;

// Whether fd 1 and fd 2 are terminals, and whether writing to them still
// works (a closed pipe is not written to again).
struct Console {
  bool terminal[3] = {false, isatty(STDOUT_FILENO) == 1,
                      isatty(STDERR_FILENO) == 1};
  bool broken[3] = {false, false, false};
};

Console& TheConsole() {
  static Console console;
  return console;
}

// Writes all of `text`; false on an error (errno set).
bool WriteAll(int fd, absl::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// One write to the console's fd 1 or 2: on a terminal, back to the line's
// start and erase it first (a worker's bar drawn in place, see concord-train,
// gives way to the line; the worker draws it again on its next update).
void ToConsole(int fd, absl::string_view text, bool newline) {
  Console& c = TheConsole();
  if (c.broken[fd]) return;
  std::string out;
  out.reserve(text.size() + 8);
  if (c.terminal[fd]) out = "\r\x1b[K";
  out.append(text.data(), text.size());
  if (newline) out.push_back('\n');
  if (!WriteAll(fd, out)) c.broken[fd] = true;
}

// What a terminal shows of a line written with carriage returns: the text
// after the last one (a bar's last frame), trailing ones aside ("\r\n").
absl::string_view Visible(absl::string_view line) {
  while (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t cr = line.rfind('\r');
  return cr == absl::string_view::npos ? line : line.substr(cr + 1);
}

std::string Prefix(const Worker& w) {
  return absl::StrCat("[worker ", w.index, "] ");
}

void EmitLine(const Worker& w, Stream& s, absl::string_view raw) {
  const absl::string_view line = Visible(raw);
  if (s.console > 0) ToConsole(s.console, absl::StrCat(Prefix(w), line), true);
  if (s.keep_tail) {
    s.tail.emplace_back(line);
    if (s.tail.size() > kTailLines) s.tail.pop_front();
  }
}

void ToFile(Stream& s, absl::string_view bytes) {
  if (s.file < 0) return;
  if (!WriteAll(s.file, bytes)) {
    Say(absl::StrCat("cannot write ", s.path, ": ", std::strerror(errno),
                     "; no more of it goes there"));
    close(s.file);
    s.file = -1;
  }
}

void End(const Worker& w, Stream& s) {
  if (!s.partial.empty()) {
    EmitLine(w, s, s.partial);
    s.partial.clear();
  }
  close(s.fd);
  s.fd = -1;
  if (s.file >= 0) {
    close(s.file);
    s.file = -1;
  }
}

// Reads once; false when nothing is left to read now (or at the end).
bool ReadOnce(const Worker& w, Stream& s) {
  char buf[16384];
  const ssize_t n = read(s.fd, buf, sizeof(buf));
  if (n < 0 && errno == EINTR) return true;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  if (n <= 0) {  // the end (EIO: a pseudo-terminal's last writer is gone)
    End(w, s);
    return false;
  }
  const absl::string_view bytes(buf, static_cast<size_t>(n));
  ToFile(s, bytes);
  s.partial.append(bytes.data(), bytes.size());
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos;
       start = nl + 1) {
    EmitLine(w, s, absl::string_view(s.partial).substr(start, nl - start));
  }
  s.partial.erase(0, start);
  while (s.partial.size() >= kMaxLine) {
    EmitLine(w, s, absl::string_view(s.partial).substr(0, kMaxLine));
    s.partial.erase(0, kMaxLine);
  }
  // A bar redrawn in place on a pseudo-terminal: its newest frame, in place.
  if (s.terminal && s.console > 0 &&
      s.partial.find('\r') != std::string::npos) {
    ToConsole(s.console, absl::StrCat(Prefix(w), Visible(s.partial)), false);
  }
  return true;
}

// A pseudo-terminal for a worker's stdout shown on the terminal: the
// parent's end (non-blocking) and the child's. Output as written ('\n'
// stays '\n'), the terminal's window size. False when none can be made.
bool OpenPty(int* parent, int* child) {
  const int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return false;
  char name[128];
  if (grantpt(master) != 0 || unlockpt(master) != 0 ||
      ptsname_r(master, name, sizeof(name)) != 0) {
    close(master);
    return false;
  }
  const int slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (slave < 0) {
    close(master);
    return false;
  }
  termios t;
  if (tcgetattr(slave, &t) == 0) {
    t.c_oflag &= ~static_cast<tcflag_t>(OPOST);
    tcsetattr(slave, TCSANOW, &t);
  }
  winsize size;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0) {
    ioctl(slave, TIOCSWINSZ, &size);
  }
  fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK);
  *parent = master;
  *child = slave;
  return true;
}

// A pipe: the parent's end non-blocking. Exits 1 when none can be made.
void OpenPipe(int* parent, int* child) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    Say(absl::StrCat("pipe: ", std::strerror(errno)));
    std::exit(1);
  }
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  *parent = fds[0];
  *child = fds[1];
}

// With --log-dir: the run's log file `name`, or -1 (said why).
int OpenLog(const std::string& dir, const char* name, std::string* path) {
  *path = dir + "/" + name;
  const int fd =
      open(path->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    Say(absl::StrCat("cannot create ", *path, ": ", std::strerror(errno),
                     "; this stream goes to the console"));
  }
  return fd;
}

}  // namespace

[[noreturn]] void UsageError(const std::string& message) {
  Say(message);
  std::exit(2);
}

void Say(absl::string_view message) {
  ToConsole(STDERR_FILENO, absl::StrCat("concord-run: ", message), true);
}

void PrepareLogDir(const Options& o) {
  namespace fs = std::filesystem;
  const std::string& dir = o.log_dir;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    UsageError("--log-dir " + dir + ": not a directory");
  }
  fs::create_directories(dir, ec);
  if (ec) UsageError("--log-dir " + dir + ": " + ec.message());
  for (int i = 0; i < o.nproc; ++i) {
    const std::string sub = absl::StrCat(dir, "/worker-", i);
    if (mkdir(sub.c_str(), 0755) == 0) continue;
    if (errno == EEXIST) {
      UsageError("--log-dir " + dir + ": " + sub +
                 " exists (the logs of an earlier run?); give a new or empty "
                 "directory");
    }
    UsageError("--log-dir " + dir + ": cannot create " + sub + ": " +
               std::strerror(errno));
  }
}

ChildEnds OpenStreams(const Options& o, Worker& w) {
  ChildEnds ends;
  w.out.console = (o.console & kConsoleStdout) != 0 ? STDOUT_FILENO : -1;
  w.err.console = (o.console & kConsoleStderr) != 0 ? STDERR_FILENO : -1;
  w.err.keep_tail = true;
  if (!o.log_dir.empty()) {
    const std::string dir =
        absl::StrCat(o.log_dir, "/worker-", w.index, "/run-", w.restarts);
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      Say(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno),
                       "; worker ", w.index, "'s output goes to the console"));
    } else {
      w.out.file = OpenLog(dir, "stdout.log", &w.out.path);
      w.err.file = OpenLog(dir, "stderr.log", &w.err.path);
    }
    // Never lost: without its file a stream is shown.
    if (w.out.file < 0) w.out.console = STDOUT_FILENO;
    if (w.err.file < 0) w.err.console = STDERR_FILENO;
  }
  if (!(w.out.console == STDOUT_FILENO && TheConsole().terminal[1] &&
        (w.out.terminal = OpenPty(&w.out.fd, &ends.out)))) {
    OpenPipe(&w.out.fd, &ends.out);
  }
  OpenPipe(&w.err.fd, &ends.err);
  return ends;
}

void Pump(const Worker& w, Stream& s) {
  // A bounded amount per call, so that one chatty worker does not hold up
  // the others.
  for (int i = 0; i < 16 && s.fd >= 0 && ReadOnce(w, s); ++i) {
  }
}

void Drain(Worker& w) {
  for (Stream* s : {&w.out, &w.err}) {
    while (s->fd >= 0 && ReadOnce(w, *s)) {
    }
  }
}

std::vector<std::string> StderrTail(const Worker& w, size_t lines) {
  std::vector<std::string> out(w.err.tail.begin(), w.err.tail.end());
  if (!w.err.partial.empty()) out.emplace_back(Visible(w.err.partial));
  if (out.size() > lines) out.erase(out.begin(), out.end() - lines);
  return out;
}

}  // namespace concord::launcher
