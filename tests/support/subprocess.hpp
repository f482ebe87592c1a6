// Start a program with arguments and an extra environment, read its stdout, wait for it.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace flashjit::test {

class Subprocess {
 public:
  Subprocess(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::vector<std::string> env_storage;
    for (char** e = environ; *e; ++e) env_storage.emplace_back(*e);
    for (const auto& e : extra_env) env_storage.push_back(e);
    std::vector<char*> envp;
    for (auto& e : env_storage) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(fds[0]);
      throw std::runtime_error("cannot start " + args[0]);
    }
    out_fd_ = fds[0];
  }
  ~Subprocess() {
    if (pid_ > 0 && !waited_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (out_fd_ >= 0) ::close(out_fd_);
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }

  // Reads stdout to EOF, then reaps the process. Returns the exit status (128 + signal if killed).
  int wait() {
    char buffer[4096];
    ssize_t n;
    while (out_fd_ >= 0 && (n = ::read(out_fd_, buffer, sizeof buffer)) > 0) output_.append(buffer, n);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    waited_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  const std::string& output() const { return output_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool waited_ = false;
  std::string output_;
};

}  // namespace flashjit::test
