// disagg-node: one process of a multi-process cluster (router, prefill,
// decode or frontend), configured by a CAF config file and command-line options:
//   disagg-node --config-file=config/local/router.ini [--node.port=4600 ...]
// Options: config/README.md. Runs until SIGINT/SIGTERM.
#include "node/runtime.h"
#include "http/frontend.h"

int main(int argc, char** argv) { return disagg::node_main(argc, argv, disagg::http::run_frontend); }
