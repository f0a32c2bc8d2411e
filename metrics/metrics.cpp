#include "metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace disagg::metrics {

namespace {

// C++17 has no atomic<double>::fetch_add: a compare-exchange loop, lock-free.
void atomic_add(std::atomic<double>& target, double by) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + by, std::memory_order_relaxed)) {
  }
}

std::string escape_help(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// {a="x",b="y"} (with `extra` appended, e.g. le="0.5"); empty without labels.
std::string label_set(const std::vector<std::string>& names, const std::vector<std::string>& values,
                      const std::string& extra = {}) {
  if (names.empty() && extra.empty()) return {};
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ",";
    out += names[i] + "=\"" + escape_label_value(values[i]) + "\"";
  }
  if (!extra.empty()) out += (names.empty() ? "" : ",") + extra;
  return out + "}";
}

void render_header(std::string& out, const std::string& name, const std::string& help, Type type) {
  out += "# HELP " + name + " " + escape_help(help) + "\n";
  out += "# TYPE " + name + " " + type_name(type) + "\n";
}

template <class Metric>
void render_simple(std::string& out, const Family<Metric>& family, Type type) {
  render_header(out, family.name(), family.help(), type);
  for (const auto& [values, metric] : family.children())
    out += family.name() + label_set(family.label_names(), values) + " " + format_value(metric->value()) + "\n";
}

void render_histogram(std::string& out, const Family<Histogram>& family) {
  render_header(out, family.name(), family.help(), Type::histogram);
  for (const auto& [values, h] : family.children()) {
    const std::vector<uint64_t> counts = h->cumulative_counts();
    for (size_t i = 0; i < counts.size(); ++i) {
      const std::string le = i < h->bounds().size() ? format_value(h->bounds()[i]) : "+Inf";
      out += family.name() + "_bucket" + label_set(family.label_names(), values, "le=\"" + le + "\"") + " " +
             std::to_string(counts[i]) + "\n";
    }
    out += family.name() + "_sum" + label_set(family.label_names(), values) + " " + format_value(h->sum()) + "\n";
    out += family.name() + "_count" + label_set(family.label_names(), values) + " " +
           std::to_string(counts.back()) + "\n";
  }
}

}  // namespace

void Counter::inc(double by) {
  if (by > 0) atomic_add(value_, by);
}

void Gauge::add(double by) { atomic_add(value_, by); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end())
    throw std::invalid_argument("histogram bounds must be strictly ascending");
  buckets_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::observe(double v) {
  // The first bound >= v (Prometheus buckets are "less than or equal").
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  atomic_add(sum_, v);
}

std::vector<uint64_t> Histogram::cumulative_counts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

uint64_t Histogram::count() const { return cumulative_counts().back(); }

const char* type_name(Type type) {
  switch (type) {
    case Type::counter: return "counter";
    case Type::gauge: return "gauge";
    case Type::histogram: return "histogram";
  }
  return "untyped";
}

template <class Metric>
Metric* Family<Metric>::make() {
  if constexpr (std::is_same_v<Metric, Histogram>) return new Histogram(bounds_);
  else return new Metric();
}

template <class Metric>
Metric& Family<Metric>::with(const std::vector<std::string>& values) {
  if (values.size() != label_names_.size())
    throw std::invalid_argument(name_ + ": " + std::to_string(label_names_.size()) + " label value(s) expected, got " +
                                std::to_string(values.size()));
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = index_.find(values); it != index_.end()) return *it->second;
  children_.emplace_back(values, std::unique_ptr<Metric>(make()));
  Metric* child = children_.back().second.get();
  index_.emplace(values, child);
  return *child;
}

template <class Metric>
std::vector<std::pair<std::vector<std::string>, const Metric*>> Family<Metric>::children() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::vector<std::string>, const Metric*>> out;
  for (const auto& [values, child] : children_) out.emplace_back(values, child.get());
  return out;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

void Registry::claim(const std::string& name, Type type, const std::vector<std::string>& label_names) {
  if (!valid_metric_name(name)) throw std::invalid_argument("invalid metric name " + name);
  const std::string suffix = "_total";
  const bool total = name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  if (type == Type::counter && !total) throw std::invalid_argument("counter " + name + " must end in _total");
  if (type != Type::counter && total) throw std::invalid_argument(name + ": only counters end in _total");
  for (const auto& l : label_names) {
    if (!valid_label_name(l)) throw std::invalid_argument(name + ": invalid label name " + l);
    if (type == Type::histogram && l == "le") throw std::invalid_argument(name + ": a histogram cannot have label le");
  }
  for (const auto& e : entries_) {
    const std::string& other = e.type == Type::counter     ? static_cast<Family<Counter>*>(e.family)->name()
                               : e.type == Type::gauge     ? static_cast<Family<Gauge>*>(e.family)->name()
                                                           : static_cast<Family<Histogram>*>(e.family)->name();
    if (other == name) throw std::invalid_argument("metric " + name + " registered twice");
  }
}

template <class Metric, class... Extra>
Family<Metric>& Registry::add(std::deque<std::unique_ptr<Family<Metric>>>& families, Type type,
                              const std::string& name, const std::string& help, std::vector<std::string> label_names,
                              Extra&&... extra) {
  std::lock_guard<std::mutex> lock(mutex_);
  claim(name, type, label_names);
  families.push_back(
      std::make_unique<Family<Metric>>(name, help, std::move(label_names), std::forward<Extra>(extra)...));
  entries_.push_back({type, families.back().get()});
  return *families.back();
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   std::vector<std::string> label_names) {
  return add(counters_, Type::counter, name, help, std::move(label_names));
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names) {
  return add(gauges_, Type::gauge, name, help, std::move(label_names));
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                       std::vector<std::string> label_names) {
  Histogram check(bounds);  // throws on bad bounds now, not at the first child
  return add(histograms_, Type::histogram, name, help, std::move(label_names), std::move(bounds));
}

std::string Registry::render() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  for (const auto& e : entries_) {
    switch (e.type) {
      case Type::counter: render_simple(out, *static_cast<const Family<Counter>*>(e.family), e.type); break;
      case Type::gauge: render_simple(out, *static_cast<const Family<Gauge>*>(e.family), e.type); break;
      case Type::histogram: render_histogram(out, *static_cast<const Family<Histogram>*>(e.family)); break;
    }
  }
  return out;
}

bool valid_metric_name(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!(letter || (i > 0 && digit))) return false;
  }
  return true;
}

bool valid_label_name(const std::string& name) {
  return valid_metric_name(name) && name.compare(0, 2, "__") != 0;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  // The shortest of %.15g .. %.17g that reads back as the same double.
  for (int precision = std::numeric_limits<double>::digits10; precision <= std::numeric_limits<double>::max_digits10;
       ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string escape_label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace disagg::metrics
