// Validates Kubernetes manifests against the JSON schemas bundled with the
// npm package kubernetes-models (offline; pinned by package-lock.json), and
// rejects unknown fields as `kubectl --validate=strict` does: the package's
// schemas allow them, so the field names come from its type declarations
// (each model's .d.ts lists its properties and their types).
//
//   node validate.mjs FILE.yaml...
//
// Prints one JSON line per document: {"file", "index", "kind", "name",
// "ok", "error"}; exits 1 when any document is invalid or of a kind it does
// not know, 2 on a file it cannot read or parse.
import { existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { parseAllDocuments } from "yaml";

const require = createRequire(import.meta.url);
const modelsRoot = dirname(require.resolve("kubernetes-models/package.json"));
const nodeModules = dirname(modelsRoot);

// {properties: {name: {kind: "object"|"array"|"map"|"leaf", file}}} of the
// interface a .d.ts file declares first; null when it declares none (a
// type alias such as Quantity or IntOrString: a leaf).
const interfaces = new Map();
function readInterface(file) {
  if (interfaces.has(file)) return interfaces.get(file);
  let result = null;
  if (existsSync(file)) {
    const text = readFileSync(file, "utf8").replace(/\/\*\*[\s\S]*?\*\//g, "");
    const imports = new Map();
    for (const m of text.matchAll(/import \{ (\w+) \} from "([^"]+)";/g)) {
      const spec = m[2];
      imports.set(m[1], spec.startsWith(".") ? join(dirname(file), spec + ".d.ts")
                                             : join(nodeModules, spec + ".d.ts"));
    }
    const body = text.match(/export interface \w+(?: extends [^{]+)? \{\n([\s\S]*?)\n\}/);
    if (body) {
      result = { properties: {} };
      const parts = body[1].split(/\n(?=    ")/);
      for (const part of parts) {
        const m = part.match(/^\s*"([^"]+)"\??:\s*([\s\S]*?);?\s*$/);
        if (!m) continue;
        const type = m[2].trim();
        const ref = type.match(/\b(IIoK8s\w+)\b/);
        let kind = "leaf";
        if (ref && imports.has(ref[1])) {
          if (type.startsWith("{")) kind = "map";
          else if (type.startsWith("Array<")) kind = "array";
          else if (type === ref[1]) kind = "object";
        }
        result.properties[m[1]] = { kind, file: ref ? imports.get(ref[1]) : null };
      }
    }
  }
  interfaces.set(file, result);
  return result;
}

// Paths of fields the declarations do not know, under `path`.
function unknownFields(data, file, path, found) {
  const shape = readInterface(file);
  if (shape === null || data === null || typeof data !== "object" || Array.isArray(data)) {
    return found;
  }
  for (const [key, value] of Object.entries(data)) {
    const p = shape.properties[key];
    if (p === undefined) {
      found.push(`${path}/${key}`);
      continue;
    }
    if (p.kind === "object") unknownFields(value, p.file, `${path}/${key}`, found);
    if (p.kind === "array" && Array.isArray(value)) {
      value.forEach((v, i) => unknownFields(v, p.file, `${path}/${key}/${i}`, found));
    }
    if (p.kind === "map" && value && typeof value === "object") {
      for (const [k, v] of Object.entries(value)) {
        unknownFields(v, p.file, `${path}/${key}/${k}`, found);
      }
    }
  }
  return found;
}

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
      const declaration = join(modelsRoot, data.apiVersion, `${data.kind}.d.ts`);
      if (readInterface(declaration) === null) {
        throw new Error(`no type declaration for ${data.apiVersion} ${data.kind}`);
      }
      const unknown = unknownFields(data, declaration, "data", []);
      if (unknown.length > 0) {
        throw new Error(`unknown field(s) ${unknown.join(", ")}`);
      }
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
