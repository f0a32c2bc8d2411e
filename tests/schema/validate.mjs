// Validates generated outputs against their schemas with Ajv (JSON Schema
// 2020-12 and ajv-formats), independently of the grammar engine.
//   node validate.mjs IN.json OUT.json
// IN: [{"schema": {...}, "outputs": ["<json text>", ...]}, ...]
// OUT: {"schemas": N, "checked": N, "failures": [{"schema": i, "text": "...", "errors": [...]}]}
import { readFileSync, writeFileSync } from "node:fs";
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";

const [input, output] = process.argv.slice(2);
const cases = JSON.parse(readFileSync(input, "utf8"));
const ajv = new Ajv2020({ strict: false, allErrors: false, validateFormats: true });
addFormats(ajv);
let checked = 0;
const failures = [];
cases.forEach((c, i) => {
  // (the suite's draft 4 schemas name their draft: the 2020-12 validator reads them as 2020-12)
  let schema = c.schema;
  if (schema && typeof schema === "object") {
    schema = { ...schema };
    delete schema.$schema;
  }
  const validate = ajv.compile(schema);
  for (const text of c.outputs) {
    ++checked;
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      failures.push({ schema: i, text, errors: ["not JSON: " + e.message] });
      continue;
    }
    if (!validate(value)) failures.push({ schema: i, text, errors: validate.errors });
  }
});
writeFileSync(output, JSON.stringify({ schemas: cases.length, checked, failures }));
