#define CATCH_CONFIG_RUNNER
#include "support/catch_session.hpp"

int main(int argc, char** argv) {
  Catch::Session session;
  if (int rc = flashjit::test::parse_or_refuse(session, argc, argv); rc >= 0) return rc;
  return session.run();
}
