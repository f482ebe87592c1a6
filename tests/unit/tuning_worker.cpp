// Test helper: one writer of the concurrent tuning-database tests.
//   flashjit_tuning_worker <db_path> <first> <count>
// saves entries [first, first + count) one save_merged() at a time, each with its own problem key.
// Exit 0 on success, 1 with the error on stderr.
#include <cstdio>
#include <cstdlib>

#include "flashjit/tuning.hpp"
#include "support/tuning_entries.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <db_path> <first> <count>\n", argv[0]);
    return 2;
  }
  try {
    const int first = std::atoi(argv[2]), count = std::atoi(argv[3]);
    for (int i = first; i < first + count; ++i) {
      flashjit::TuningDb db;
      db.upsert(flashjit::test::numbered_entry(i));
      db.save_merged(argv[1]);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
