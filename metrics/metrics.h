// A small Prometheus metrics library (CAF-free): counters, gauges and
// histograms with labels, and the Prometheus text exposition format 0.0.4.
//
// Updates are lock-free (relaxed atomics; a histogram's buckets are atomics
// too), so an actor can update a metric in its handler without ever blocking.
// Only creating a labelled child (Family::with) takes a mutex: do it once at
// start-up and keep the reference (children live as long as their family).
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace disagg::metrics {

// Monotonically increasing. Its family's name ends in "_total".
class Counter {
 public:
  void inc(double by = 1.0);  // by < 0 is ignored (a counter never goes down)
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void add(double by);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted in buckets with fixed upper bounds (ascending; +Inf is
// implicit), plus their sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts per bound, the +Inf bucket last (= the count).
  std::vector<uint64_t> cumulative_counts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1, not cumulative
  std::atomic<double> sum_{0.0};
};

enum class Type { counter, gauge, histogram };
const char* type_name(Type type);

// One metric name, its help text and label names; a child per label-value tuple.
template <class Metric>
class Family {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds = {})
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}

  // The child for these label values (created on first use; the same object
  // afterwards). Throws std::invalid_argument when the number of values
  // differs from the number of label names.
  Metric& with(const std::vector<std::string>& values);
  // The child without labels (a family with no label names).
  Metric& get() { return with({}); }

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // (label values, child) pairs in creation order, for rendering.
  std::vector<std::pair<std::vector<std::string>, const Metric*>> children() const;

 private:
  Metric* make();
  std::string name_, help_;
  std::vector<std::string> label_names_;
  std::vector<double> bounds_;  // histograms only
  mutable std::mutex mutex_;
  std::map<std::vector<std::string>, Metric*> index_;
  std::deque<std::pair<std::vector<std::string>, std::unique_ptr<Metric>>> children_;
};

// A set of families rendered together (one process's /metrics).
class Registry {
 public:
  // A family's name must be a valid Prometheus metric name, unique in the
  // registry (std::invalid_argument otherwise); label names valid, not "le"
  // for histograms. Counters' names must end in "_total".
  Family<Counter>& counter(const std::string& name, const std::string& help,
                           std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                               std::vector<std::string> label_names = {});

  // Every family in the Prometheus text format 0.0.4, in registration order.
  std::string render() const;

 private:
  void claim(const std::string& name, Type type, const std::vector<std::string>& label_names);
  // Claims the name and keeps a new family of `Metric` in `families`.
  template <class Metric, class... Extra>
  Family<Metric>& add(std::deque<std::unique_ptr<Family<Metric>>>& families, Type type, const std::string& name,
                      const std::string& help, std::vector<std::string> label_names, Extra&&... extra);
  mutable std::mutex mutex_;
  struct Entry {
    Type type;
    void* family;
  };
  std::vector<Entry> entries_;
  std::deque<std::unique_ptr<Family<Counter>>> counters_;
  std::deque<std::unique_ptr<Family<Gauge>>> gauges_;
  std::deque<std::unique_ptr<Family<Histogram>>> histograms_;
};

// The content type of render()'s output.
inline constexpr const char* kTextContentType = "text/plain; version=0.0.4; charset=utf-8";

// Prometheus's rules: [a-zA-Z_:][a-zA-Z0-9_:]* for metric names (we also
// refuse ':', which is for recording rules), [a-zA-Z_][a-zA-Z0-9_]* for labels
// (not starting with "__").
bool valid_metric_name(const std::string& name);
bool valid_label_name(const std::string& name);
// A sample value as the text format writes it (+Inf, -Inf, NaN, shortest round trip).
std::string format_value(double v);
// A label value with \, " and newline escaped.
std::string escape_label_value(const std::string& v);

}  // namespace disagg::metrics
