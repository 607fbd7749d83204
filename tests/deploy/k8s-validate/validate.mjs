// Validates Kubernetes manifests against the JSON schemas bundled with the
// npm package kubernetes-models (offline; pinned by package-lock.json).
//
//   node validate.mjs FILE.yaml...
//
// Prints one JSON line per document: {"file", "index", "kind", "name",
// "ok", "error"}; exits 1 when any document is invalid or of a kind it does
// not know, 2 on a file it cannot read or parse.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

// apiVersion -> module of kubernetes-models ("v1", "apps/v1", ...).
async function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== "string" || !/^[a-z0-9.]*\/?v[0-9a-z]+$/.test(apiVersion)) {
    throw new Error(`unknown apiVersion ${JSON.stringify(apiVersion)}`);
  }
  let module;
  try {
    module = await import(`kubernetes-models/${apiVersion}`);
  } catch (e) {
    throw new Error(`unknown apiVersion ${apiVersion}`);
  }
  if (typeof module[kind] !== "function") {
    throw new Error(`unknown kind ${kind} in ${apiVersion}`);
  }
  return module[kind];
}

let failed = false;
for (const file of process.argv.slice(2)) {
  let docs;
  try {
    // YAML 1.1, as Kubernetes reads manifests (0440 is octal there).
    docs = parseAllDocuments(readFileSync(file, "utf8"), { version: "1.1" });
  } catch (e) {
    console.error(`validate.mjs: ${file}: ${e.message}`);
    process.exit(2);
  }
  let index = 0;
  for (const doc of docs) {
    if (doc.errors.length > 0) {
      console.error(`validate.mjs: ${file}: ${doc.errors[0].message}`);
      process.exit(2);
    }
    const data = doc.toJS();
    if (data === null || data === undefined) continue;  // empty document
    const result = { file, index, kind: data.kind, name: data.metadata?.name, ok: true, error: "" };
    try {
      if (data.kind === "Kustomization") {
        throw new Error("not a Kubernetes object (kustomization.yaml is checked elsewhere)");
      }
      const Model = await modelFor(data.apiVersion, data.kind);
      new Model(data).validate();
    } catch (e) {
      result.ok = false;
      result.error = e.message;
      failed = true;
    }
    console.log(JSON.stringify(result));
    ++index;
  }
}
process.exit(failed ? 1 : 0);
