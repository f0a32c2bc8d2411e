// What the structured-output tests of the official client ask for
// (structured_test.mjs, responses_test.mjs): a person, whose name and age
// test_cluster checks against these bounds.
export const person = {
  type: "object",
  properties: { name: { type: "string", maxLength: 8 }, age: { type: "integer", minimum: 0, maximum: 120 } },
  required: ["name", "age"],
  additionalProperties: false,
};
