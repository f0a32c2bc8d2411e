// The protocol without a model: messages survive serialization (so they can
// cross nodes), the configuration validates and parses, and the router's
// choices (validation, worker picks, session affinity) are what they claim.
#include <gtest/gtest.h>

#include <regex>

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>

#include "actors/config.h"
#include "actors/router_policy.h"
#include "node/config.h"
#include "node/tls.h"
#include "caf/all.hpp"
#include "messages/protocol.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

template <class T>
T round_trip(caf::actor_system& system, T value) {
  std::vector<char> buffer;
  caf::binary_serializer sink{system, buffer};
  EXPECT_FALSE(sink(value));
  T copy;
  caf::binary_deserializer source{system, buffer};
  EXPECT_FALSE(source(copy));
  return copy;
}

TEST(Protocol, MessagesSurviveSerialization) {
  DisaggSystemConfig config;
  caf::actor_system system{config};

  GenerateRequest request;
  request.id = 0x1234567890abcdefull;
  request.prompt_tokens = {1, 403, 407};
  request.prompt_text = "Once";
  request.prompt_is_text = true;
  request.max_new_tokens = 17;
  request.sampling = Sampling{0.8f, 0.9f, 42};
  request.session = "s";
  request.deadline_ms = 1500;
  request.token_text = false;
  EXPECT_EQ(caf::deep_to_string(round_trip(system, request)), caf::deep_to_string(request));
  EXPECT_FALSE(round_trip(system, request).token_text);

  KvTransfer transfer;
  transfer.id = 7;
  transfer.prompt_len = 3;
  transfer.max_new_tokens = 9;
  transfer.first_token = 261;
  transfer.bytes = {0, 1, 2, 250, 251, 252};
  const KvTransfer t2 = round_trip(system, transfer);
  EXPECT_EQ(t2.bytes, transfer.bytes);
  EXPECT_EQ(t2.first_token, 261);
  EXPECT_EQ(t2.chunk_count, 1u);

  RequestOutcome outcome = make_failure(9, ErrorCode::kv_too_large, "too big");
  outcome.tokens = {5, 6};
  outcome.finish = FinishReason::eos;
  outcome.timings.decode_us = 77;
  const RequestOutcome o2 = round_trip(system, outcome);
  EXPECT_EQ(o2.code, ErrorCode::kv_too_large);
  EXPECT_EQ(o2.finish, FinishReason::eos);
  EXPECT_EQ(o2.timings.decode_us, 77);
  EXPECT_EQ(caf::deep_to_string(o2), caf::deep_to_string(outcome));

  TokenBatch batch{{TokenEvent{3, 0, 261, "", 16}, TokenEvent{4, 5, 7, "x", 0}}};
  const TokenBatch b2 = round_trip(system, batch);
  ASSERT_EQ(b2.events.size(), 2u);
  EXPECT_EQ(b2.events[1].index, 5);
  EXPECT_EQ(caf::deep_to_string(b2), caf::deep_to_string(batch));

  RouterStatus status;
  WorkerStatus worker;
  worker.name = "decode-0";
  worker.role = WorkerRole::decode;
  worker.fingerprint = 99;
  worker.free_blocks = 10;
  worker.total_blocks = 20;
  worker.active_sequences = 1;
  status.workers.push_back(worker);
  EXPECT_EQ(caf::deep_to_string(round_trip(system, status)), caf::deep_to_string(status));
}

TEST(Protocol, EveryMessageTypeIsRegistered) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  for (const char* name :
       {"disagg::Sampling", "disagg::GenerateRequest", "disagg::TokenEvent", "disagg::TokenBatch", "disagg::Timings",
        "disagg::RequestOutcome", "disagg::ModelInfo", "disagg::WorkerInfo", "disagg::DecodeLoad",
        "disagg::PrefillLoad", "disagg::WorkerStatus", "disagg::RouterStatus", "disagg::PrefillJob",
        "disagg::PrefillReport", "disagg::KvTransfer", "disagg::KvAck", "disagg::DecodeDone",
        "disagg::PrefillWork", "disagg::PrefillResult", "disagg::KvAdmit", "disagg::AdmitResult",
        "disagg::StepSlot", "disagg::DecodeStep", "disagg::StepResult", "disagg::client_actor",
        "disagg::compute_actor", "disagg::decode_actor", "disagg::prefill_actor",
        "disagg::router_actor"})
    EXPECT_NE(system.types().make_value(name), nullptr) << name;
}

TEST(Protocol, ErrorCodesHaveNames) {
  EXPECT_EQ(to_string(ErrorCode::kv_too_large), "kv_too_large");
  EXPECT_EQ(to_string(ErrorCode::incompatible_kv), "incompatible_kv");
  EXPECT_EQ(to_string(ErrorCode::worker_lost), "worker_lost");
  EXPECT_EQ(to_string(FinishReason::eos), "eos");
}

TEST(Config, DefaultsAreValidAndBadValuesAreNamed) {
  DisaggConfig config;
  EXPECT_EQ(config.validate(), "");
  config.block_size = 8;  // not whole key tiles of 16
  config.backend = "tpu";
  config.max_kv_transfer_bytes = 0;
  config.max_prompt_bytes = 0;
  config.default_deadline_ms = kMaxDeadlineMs + 1;
  config.prefill_chunk = -1;
  config.ack_timeout_ms = kMaxDeadlineMs + 1;
  config.heartbeat_timeout_ms = kMaxDeadlineMs + 1;
  config.compute_timeout_ms = kMaxDeadlineMs + 1;
  config.heartbeat_interval_ms = kMaxDeadlineMs + 1;
  const std::string problems = config.validate();
  for (const char* timeout : {"ack-timeout-ms", "heartbeat-timeout-ms", "compute-timeout-ms", "heartbeat-interval-ms"})
    EXPECT_NE(problems.find(timeout), std::string::npos) << timeout << ": " << problems;
  EXPECT_NE(problems.find("block-size"), std::string::npos) << problems;
  EXPECT_NE(problems.find("max-prompt-bytes"), std::string::npos) << problems;
  EXPECT_NE(problems.find("default-deadline-ms"), std::string::npos) << problems;
  EXPECT_NE(problems.find("backend"), std::string::npos) << problems;
  EXPECT_NE(problems.find("max-kv-transfer-bytes"), std::string::npos) << problems;
  EXPECT_NE(problems.find("prefill-chunk"), std::string::npos) << problems;
  DisaggConfig speculative;
  speculative.speculation = "eagle";
  speculative.num_speculative_tokens = 17;
  speculative.prompt_lookup_min = 5;
  const std::string why = speculative.validate();
  EXPECT_NE(why.find("speculation must be"), std::string::npos) << why;
  EXPECT_NE(why.find("num-speculative-tokens"), std::string::npos) << why;
  EXPECT_NE(why.find("prompt-lookup-min"), std::string::npos) << why;
  speculative = DisaggConfig{};
  speculative.speculation = "draft";
  EXPECT_NE(speculative.validate().find("draft-model"), std::string::npos);
  speculative.draft_model = "small.gguf";
  EXPECT_EQ(speculative.validate(), "");
}

TEST(Config, OptionsAreReadFromTheCommandLine) {
  DisaggSystemConfig config;
  const auto error = config.parse(caf::actor_system_config::string_list{
      "--disagg.block-size=32", "--disagg.pool-blocks=77", "--disagg.max-kv-transfer-bytes=123456",
      "--disagg.backend=cpu", "--disagg.default-deadline-ms=250",
      "--disagg.max-prompt-bytes=4096", "--disagg.prefill-chunk=0"});
  EXPECT_FALSE(error) << caf::to_string(error);
  EXPECT_EQ(config.disagg.block_size, 32);
  EXPECT_EQ(config.disagg.pool_blocks, 77);
  EXPECT_EQ(config.disagg.max_kv_transfer_bytes, 123456);
  EXPECT_EQ(config.disagg.backend, "cpu");
  EXPECT_EQ(config.disagg.default_deadline_ms, 250);
  EXPECT_EQ(config.disagg.max_prompt_bytes, 4096);
  EXPECT_EQ(config.disagg.prefill_chunk, 0);
  EXPECT_EQ(config.disagg.max_batch, DisaggConfig{}.max_batch);
}

// A README table of options (the one under `heading`) names every option
// of `options` with its type and default as the code declares them (the one
// owner of each default): a default changed in one place and not the other,
// an option added without a row, or a row left for an option that is gone
// fails. A default the README words rather than states ("(required)", "<role>@...",
// a computed one) is checked for its row and type only.
void expect_readme_table_is(const std::string& heading, const caf::config_option_set& options) {
  SCOPED_TRACE("README " + heading);
  const std::string readme = read_text_file(std::string(DISAGG_SOURCE_DIR) + "/README.md");
  const size_t begin = readme.find(heading);
  ASSERT_NE(begin, std::string::npos) << "no such table in README.md";
  const std::string section = readme.substr(begin, readme.find("\n#### ", begin + 1) - begin);
  struct Row { std::string type, value; };
  std::map<std::string, Row> rows;
  std::istringstream lines(section);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    std::vector<std::string> cells;  // name, type, default (the rest is prose)
    size_t at = 1;
    for (int c = 0; c < 3; ++c) {
      const size_t bar = line.find(" | ", at);
      std::string cell = line.substr(at, bar - at);
      cell.erase(0, cell.find_first_not_of(' '));
      cell = cell.substr(0, cell.find(' '));  // `""` (= `host`): the value, not its gloss
      cell.erase(std::remove(cell.begin(), cell.end(), '`'), cell.end());
      cells.push_back(cell);
      at = bar + 3;
    }
    rows[cells[0]] = Row{cells[1], cells[2]};
  }
  // CAF's type names as the README spells them.
  const std::map<std::string, std::string> types = {{"string", "string"}, {"int32", "int32"}, {"int64", "int64"},
                                                    {"uint16", "uint16"}, {"boolean", "bool"}, {"real64", "double"}};
  size_t seen = 0;
  for (const auto& opt : options) {
    const auto long_name = opt.long_name(), type_view = opt.type_name();
    const std::string name(long_name.data(), long_name.size()), type_name(type_view.data(), type_view.size());
    SCOPED_TRACE(name + " (" + type_name + ")");
    auto row = rows.find(name);
    ASSERT_NE(row, rows.end()) << "an option without a README row";
    ++seen;
    const auto type = types.find(type_name);
    EXPECT_TRUE(type != types.end() && type->second == row->second.type)
        << "README says " << row->second.type << ", the option is " << type_name;
    const std::string& stated = row->second.value;
    if (stated.empty() || stated[0] == '(' || stated.find('<') != std::string::npos) continue;  // worded
    const auto value = opt.get();
    ASSERT_TRUE(value);
    if (caf::holds_alternative<double>(*value))
      EXPECT_DOUBLE_EQ(std::stod(stated), caf::get<double>(*value)) << stated;
    else
      EXPECT_EQ(stated, caf::to_string(*value));
  }
  EXPECT_EQ(seen, rows.size()) << "a README row for an option that does not exist";
}

// The README's Security table ("Every bound a stranger meets") gives each
// option's default in parentheses after its name (`node.NAME` (16 MiB ...)):
// each such figure is the code's default.
TEST(Config, TheReadmesSecurityTableStatesTheCodesDefaults) {
  DisaggConfig disagg;
  NodeOptions node;
  caf::config_option_set options[2];
  add_disagg_options(options[0], disagg);
  add_node_options(options[1], node);
  const char* const prefixes[2] = {"disagg.", "node."};
  const std::string readme = read_text_file(std::string(DISAGG_SOURCE_DIR) + "/README.md");
  const size_t begin = readme.find("**Every bound a stranger meets**");
  ASSERT_NE(begin, std::string::npos) << "no Security table in README.md";
  const std::string table = readme.substr(begin, readme.find("\n\n", readme.find("| --- |", begin)) - begin);
  const std::regex stated("`(disagg|node)\\.([a-z0-9-]+)` \\(([0-9]+)( KiB| MiB| GiB)?");
  int checked = 0;
  for (auto it = std::sregex_iterator(table.begin(), table.end(), stated); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    SCOPED_TRACE(m.str());
    const int set = m[1] == "disagg" ? 0 : 1;
    const caf::config_option* opt = nullptr;
    for (const auto& o : options[set])
      if (std::string(o.long_name().data(), o.long_name().size()) == m[2].str()) opt = &o;
    ASSERT_NE(opt, nullptr) << "no option " << prefixes[set] << m[2];
    const std::string unit = m[4];
    const int shift = unit == " KiB" ? 10 : unit == " MiB" ? 20 : unit == " GiB" ? 30 : 0;
    const auto value = opt->get();
    ASSERT_TRUE(value);
    EXPECT_EQ(std::to_string(std::stoll(m[3]) << shift), caf::to_string(*value));
    ++checked;
  }
  EXPECT_GE(checked, 8) << "the table's options were not found\n" << table;
}

TEST(Config, TheReadmesOptionTablesAreTheCodesDefaults) {
  DisaggConfig disagg;
  caf::config_option_set disagg_options;
  add_disagg_options(disagg_options, disagg);
  expect_readme_table_is("#### `[disagg]`", disagg_options);
  NodeOptions node;
  caf::config_option_set node_options;
  add_node_options(node_options, node);
  expect_readme_table_is("#### `[node]`", node_options);
  TlsOptions tls;
  caf::config_option_set tls_options;
  add_tls_options(tls_options, tls);
  expect_readme_table_is("#### `[tls]`", tls_options);
}

// The layers, lowest first: the CAF-free floors gpu/ <- text/ <- model/ <-
// engine/ (grammar/ beside gpu/, under engine/), kv/ and metrics/, then
// messages/, actors/, then node/, http/ and apps/. No source includes a
// layer above its own, and the CAF-free ones include no CAF.
TEST(Layers, NoSourceIncludesALayerAboveItsOwn) {
  const std::vector<std::string> beyond_engine = {"caf/", "messages/", "actors/", "node/", "http/", "apps/", "kv/", "metrics/"};
  auto plus = [](std::vector<std::string> v, std::initializer_list<const char*> more) {
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  const std::map<std::string, std::vector<std::string>> forbidden = {
      {"gpu", plus(beyond_engine, {"text/", "model/", "engine/", "grammar/"})},
      {"grammar", plus(beyond_engine, {"gpu/", "text/", "model/", "engine/"})},
      {"text", plus(beyond_engine, {"model/", "engine/", "grammar/"})},
      {"model", plus(beyond_engine, {"engine/", "grammar/"})},
      {"engine", beyond_engine},
      {"kv", {"caf/", "messages/", "actors/", "node/", "http/", "apps/", "metrics/"}},
      {"metrics", {"caf/", "messages/", "actors/", "node/", "http/", "apps/"}},
      {"messages", {"actors/", "node/", "http/", "apps/"}},
      {"actors", {"node/", "http/", "apps/"}},
  };
  size_t files = 0;
  for (const auto& [layer, above] : forbidden) {
    for (const auto& entry :
         std::filesystem::recursive_directory_iterator(std::string(DISAGG_SOURCE_DIR) + "/" + layer)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".inl" && ext != ".cuh") continue;
      ++files;
      std::istringstream lines(read_text_file(entry.path().string()));
      for (std::string line; std::getline(lines, line);) {
        if (line.rfind("#include", 0) != 0) continue;
        for (const std::string& up : above)
          EXPECT_EQ(line.find("\"" + up), std::string::npos) << entry.path().string() << ": " << line;
        if (layer != "messages" && layer != "actors")
          EXPECT_EQ(line.find("<caf/"), std::string::npos) << entry.path().string() << ": " << line;
      }
    }
  }
  EXPECT_GT(files, 50u) << "the layers' sources were found";
}

// The router's books of a decode worker's room: a report that predates
// the router's own reservations never frees their blocks, a release never
// makes more room than the pool, and what status and dispatch read is one
// number.
TEST(DecodeRoom, ReportsAreCappedByTheRoutersOwnReservations) {
  DecodeRoom room(10);
  EXPECT_EQ(room.free_blocks(), 10);
  room.reserve(4);
  EXPECT_EQ(room.free_blocks(), 6);
  EXPECT_EQ(room.requests(), 1);
  room.reported(DecodeLoad{10, 10, 16, 0});  // sent before the reservation arrived there
  EXPECT_EQ(room.free_blocks(), 6);
  room.reported(DecodeLoad{5, 10, 16, 1});  // the worker holds another block of its own (a cached prefix)
  EXPECT_EQ(room.free_blocks(), 5);
  EXPECT_EQ(room.active_sequences(), 1);
  room.release(4);
  EXPECT_EQ(room.free_blocks(), 9);
  EXPECT_EQ(room.requests(), 0);
  room.reserve(4);
  room.reported(DecodeLoad{10, 10, 16, 0});  // the request ended there: its blocks counted free already
  room.release(4);
  EXPECT_EQ(room.free_blocks(), 10) << "never more than the pool";
  room.reserve(12);
  EXPECT_EQ(room.free_blocks(), 0) << "never below nothing";
  room.release(12);
  // A refusal: its answer reports 2 free (the booking never held there); the
  // booking goes and nothing else comes free.
  room.reserve(6);
  room.reported(DecodeLoad{2, 10, 16, 0});
  room.refused(6);
  EXPECT_EQ(room.free_blocks(), 2);
  EXPECT_EQ(room.requests(), 0);
}

TEST(RouterPolicy, ValidationNamesTheProblem) {
  const ModelLimits limits{512, 512};
  GenerateRequest r;
  r.max_new_tokens = 10;
  EXPECT_NE(validate_request(r, {}, limits).find("empty"), std::string::npos);
  EXPECT_NE(validate_request(r, {1, 512}, limits).find("vocabulary"), std::string::npos);
  EXPECT_EQ(validate_request(r, {1, 511}, limits), "");
  r.max_new_tokens = 511;
  EXPECT_EQ(validate_request(r, {1}, limits), "");
  r.max_new_tokens = 512;
  EXPECT_NE(validate_request(r, {1}, limits).find("seq_len"), std::string::npos);
  r.max_new_tokens = 0;
  EXPECT_NE(validate_request(r, {1}, limits).find("max_new_tokens"), std::string::npos);
  r.max_new_tokens = 4;
  r.sampling.top_p = 1.5f;
  EXPECT_NE(validate_request(r, {1}, limits).find("top_p"), std::string::npos);
  r.sampling.top_p = 1.0f;
  r.deadline_ms = kMaxDeadlineMs;
  EXPECT_EQ(validate_request(r, {1}, limits), "");
  r.deadline_ms = kMaxDeadlineMs + 1;
  EXPECT_NE(validate_request(r, {1}, std::nullopt).find("deadline_ms must be in [0, 86400000]"), std::string::npos)
      << validate_request(r, {1}, std::nullopt);
  r.deadline_ms = -1;
  EXPECT_NE(validate_request(r, {1}, std::nullopt).find("deadline_ms"), std::string::npos);
  r.deadline_ms = 0;
  // Without limits only what does not depend on the model is checked.
  EXPECT_EQ(validate_request(r, {1, 99999}, std::nullopt), "");
}

TEST(RouterPolicy, PrefillGoesToTheLeastQueuedTokensWithinTheInFlightCap) {
  size_t cursor = 0;
  std::vector<PrefillCandidate> c{{1, 2, 300}, {2, 1, 40}, {3, 0, 100}};
  EXPECT_EQ(pick_prefill(c, 8, cursor), WorkerKey{2});
  EXPECT_EQ(pick_prefill(c, 1, cursor), WorkerKey{3});  // 1 and 2 are at the cap
  c[2].in_flight = 1;
  EXPECT_FALSE(pick_prefill(c, 1, cursor));
  // Ties rotate.
  std::vector<PrefillCandidate> tie{{1, 0, 0}, {2, 0, 0}};
  cursor = 0;
  const auto first = pick_prefill(tie, 8, cursor);
  const auto second = pick_prefill(tie, 8, cursor);
  EXPECT_NE(first, second);
}

// KV-aware: the worker that would have the prompt done first, its queue plus
// what it would compute of this prompt (less what its cache holds).
TEST(RouterPolicy, PrefillWeighsTheQueueAgainstWhatEachWorkerWouldCompute) {
  size_t cursor = 0;
  std::vector<PrefillCandidate> c{{1, 1, 200}, {2, 0, 0}};
  c[0].compute_tokens = 100;   // holds 900 of a 1,000-token prompt
  c[1].compute_tokens = 1000;  // idle, holds none
  EXPECT_EQ(pick_prefill(c, 8, cursor), WorkerKey{1});
  c[0].outstanding_tokens = 1200;  // now busier than the prompt is long
  EXPECT_EQ(pick_prefill(c, 8, cursor), WorkerKey{2});
}

TEST(RouterPolicy, DecodeGoesToMostRoomThenFewestSequencesThenSession) {
  size_t cursor = 0;
  // key, block_size, total, free, active
  std::vector<DecodeCandidate> c{{1, 16, 100, 10, 1}, {2, 16, 100, 50, 5}, {3, 16, 100, 50, 2}};
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {}, cursor), WorkerKey{3});
  EXPECT_EQ(pick_decode(c, 160, WorkerKey{1}, {}, cursor), WorkerKey{1});   // session, has room
  EXPECT_EQ(pick_decode(c, 161, WorkerKey{1}, {}, cursor), WorkerKey{3});   // 11 blocks: no room on 1
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {3}, cursor), WorkerKey{2});  // 3 excluded
  EXPECT_FALSE(pick_decode(c, 16 * 51, std::nullopt, {}, cursor));
  EXPECT_TRUE(any_decode_could_fit(c, 1600, {}));
  EXPECT_FALSE(any_decode_could_fit(c, 1601, {}));
  // The most a request may ask for: the largest pool, 1600 positions.
  EXPECT_EQ(most_new_tokens(c, 5), 1596);
  EXPECT_TRUE(any_decode_could_fit(c, gpu::kv_positions_needed(5, most_new_tokens(c, 5), 1 << 20), {}));
  EXPECT_FALSE(any_decode_could_fit(c, gpu::kv_positions_needed(5, most_new_tokens(c, 5) + 1, 1 << 20), {}));
  EXPECT_EQ(most_new_tokens(c, 1700), 0);
  EXPECT_EQ(most_new_tokens({}, 5), 0);
  // As gpu::generate feeds them: the last generated token is never fed back.
  EXPECT_EQ(gpu::kv_positions_needed(5, 10, 512), 14);
  EXPECT_EQ(gpu::kv_positions_needed(5, 1, 512), 5);
  EXPECT_EQ(gpu::kv_positions_needed(500, 12, 512), 511);
  EXPECT_EQ(gpu::kv_positions_needed(500, 100, 512), 512);
}

TEST(RouterPolicy, AColocatedDecodeWorkerGoesOnlyWithItsOwnPrefillWorker) {
  size_t prefill_cursor = 0, decode_cursor = 0;
  // Prefill 1 disaggregated; 2 and 3 of colocated units A (decode 12) and B (decode 13).
  std::vector<PrefillCandidate> p{{1, 0, 0, false}, {2, 0, 0, true}, {3, 0, 0, true}};
  // key, block_size, total, free, active, colocated, partner
  std::vector<DecodeCandidate> d{{11, 16, 100, 10, 0}, {12, 16, 100, 90, 0, true, 2}, {13, 16, 100, 50, 0, true, 3}};
  auto pick = [&](const std::vector<WorkerKey>& excluded = {}) {
    return pick_workers(p, d, 1, 16, std::nullopt, excluded, prefill_cursor, decode_cursor);
  };
  auto pair = pick();  // most room: unit A, with its own prefill worker
  ASSERT_TRUE(pair);
  EXPECT_EQ(pair->decode, WorkerKey{12});
  EXPECT_EQ(pair->prefill, WorkerKey{2});
  p[1].in_flight = 1;  // A's prefill worker is at the cap: A takes nothing, B does
  pair = pick();
  ASSERT_TRUE(pair);
  EXPECT_EQ(pair->decode, WorkerKey{13});
  EXPECT_EQ(pair->prefill, WorkerKey{3});
  pair = pick({13});  // B excluded: the disaggregated pair, never a colocated prefill worker
  ASSERT_TRUE(pair);
  EXPECT_EQ(pair->decode, WorkerKey{11});
  EXPECT_EQ(pair->prefill, WorkerKey{1});
  p[0].in_flight = 1;  // ... and without room there, nothing
  EXPECT_FALSE(pick({13}));
  d[2].partner = 0;  // B's prefill worker not registered: B takes nothing
  EXPECT_FALSE(pick());
  // Only colocated units: no disaggregated prefill worker is needed.
  std::vector<PrefillCandidate> units{{2, 0, 0, true}};
  std::vector<DecodeCandidate> unit_decodes{{12, 16, 100, 90, 0, true, 2}};
  pair = pick_workers(units, unit_decodes, 1, 16, std::nullopt, {}, prefill_cursor, decode_cursor);
  ASSERT_TRUE(pair);
  EXPECT_EQ(pair->prefill, WorkerKey{2});
}

TEST(RouterPolicy, SessionAffinityForgetsTheLeastRecentlyUsed) {
  SessionAffinity sessions(2);
  sessions.remember("a", 1);
  sessions.remember("b", 2);
  EXPECT_EQ(sessions.find("a"), WorkerKey{1});  // a is now the most recent
  sessions.remember("c", 3);                    // evicts b
  EXPECT_FALSE(sessions.find("b"));
  EXPECT_EQ(sessions.find("a"), WorkerKey{1});
  EXPECT_EQ(sessions.find("c"), WorkerKey{3});
  sessions.forget_worker(3);
  EXPECT_FALSE(sessions.find("c"));
  EXPECT_EQ(sessions.size(), 1u);
  SessionAffinity off(0);
  off.remember("a", 1);
  EXPECT_FALSE(off.find("a"));
}

}  // namespace
}  // namespace disagg::test
