// A pskv worker driven line by line from stdin, for the netns tests that must act at exact
// moments (cut a link between two steps of a worker). Commands, one per line:
//   init KEY FLOATS   create KEY with FLOATS zeros
//   clock             end this worker's step
//   pull KEY FLOATS   a bounded read of KEY; prints "pulling" once it is sent, then waits
// After each command it prints "ok COMMAND" (or "error: WHY" and exits 1), flushed.
//   usage: scripted_worker URI WORKER_ID
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "pskv/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s URI WORKER_ID\n", argv[0]);
    return 2;
  }
  try {
    pskv::ClientOptions o;
    o.servers = {argv[1]};
    o.worker_id = static_cast<std::uint32_t>(std::stoul(argv[2]));
    o.io_timeout = std::chrono::milliseconds(120000);  // the test, not the client, decides who gave up
    pskv::Client client(o);
    std::printf("connected\n");
    std::fflush(stdout);
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string command;
      pskv::Key key = 0;
      std::size_t floats = 0;
      in >> command >> key >> floats;
      if (command == "init") {
        client.wait(client.init(key, std::vector<float>(floats, 0.0f)));
      } else if (command == "clock") {
        client.clock();
      } else if (command == "pull") {
        std::vector<float> out(floats);
        const pskv::Ticket t = client.pull(key, out);
        std::printf("pulling\n");
        std::fflush(stdout);
        client.wait(t);
      } else {
        std::fprintf(stderr, "error: unknown command '%s'\n", line.c_str());
        return 2;
      }
      std::printf("ok %s\n", command.c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
  return 0;
}
