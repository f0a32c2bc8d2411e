// bench_compute --model FILE: one model file's figures, timed inside the
// process (a multi-GB model's load time varies by seconds, so whole-process
// timings are noise): load time and peak RSS against the file's size, the
// machine's measured read bandwidth, and per thread count single-sequence
// decode, batched decode and prefill in tokens/s, with GFLOP/s, the bytes of
// weights a decode step reads, and decode as a fraction of the bandwidth
// limit (bytes per token / read bandwidth).
#pragma once
#include <string>

namespace disagg::bench {

// The CPU's name (/proc/cpuinfo's model name), or "unknown".
std::string cpu_name();

// Runs the report for argv (bench_compute's own arguments); returns the exit code.
int model_report(int argc, char** argv);

}  // namespace disagg::bench
