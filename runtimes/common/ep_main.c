/* Kept apart from ep_cli.c so tests and fuzzers can link the runtime without a main(). */
#include "ep_runtime.h"

int main(int argc, char **argv) { return ep_cli(argc, argv); }
