#include "http/target.h"

#include <boost/url/parse.hpp>
#include <boost/url/src.hpp>  // (Boost.URL's implementation: this translation unit alone)

namespace disagg::http {

std::optional<std::string> decoded_path(const std::string& target) {
  const auto url = boost::urls::parse_origin_form(target);
  if (!url) return std::nullopt;
  return std::string(url->path());
}

}  // namespace disagg::http
