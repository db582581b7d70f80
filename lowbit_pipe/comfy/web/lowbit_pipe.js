// lowbit_pipe's ComfyUI front-end extension, served from the node pack's WEB_DIRECTORY (written by
// `python -m lowbit_pipe.comfy install`). One job: the text a pack node returns as its `ui` result (Quantize's
// summary, Export's file, Purge's proof, Compile's plan) is shown on the node itself. ComfyUI's front end draws
// a node's `ui.text` only for its own "Preview as Text" / "Save Text" nodes; this does the same for the nodes of
// the `lowbit_pipe` category, with the front end's own text preview where it has one (window.comfyAPI), else a
// read-only multiline text widget. The text is never sent back with the prompt (serialize: false).
import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";

const CATEGORY = "lowbit_pipe";
const FALLBACK = "lowbit_text";

function previewApi() {
  return window.comfyAPI?.textPreviewWidgets;
}

function fallbackWidget(node) {
  let widget = node.widgets?.find((w) => w.name === FALLBACK);
  if (widget) return widget;
  const widgets = window.comfyAPI?.widgets?.ComfyWidgets;
  if (!widgets?.STRING) return null;
  widget = widgets.STRING(node, FALLBACK, ["STRING", { multiline: true }], app).widget;
  widget.serialize = false;
  widget.options = { ...(widget.options || {}), serialize: false };
  if (widget.inputEl) widget.inputEl.readOnly = true;
  return widget;
}

function show(node, output) {
  const text = output?.text;
  if (text === undefined || text === null) return;
  const preview = previewApi();
  const before = node.widgets?.length ?? 0;
  if (preview?.addTextPreviewWidgets && preview?.updateTextPreviewWidgets) {
    if (!node.widgets?.some((w) => w.name === "preview_text")) preview.addTextPreviewWidgets(node);
    preview.updateTextPreviewWidgets(node, output);
  } else {
    const widget = fallbackWidget(node);
    if (widget) widget.value = Array.isArray(text) ? text.join("\n\n") : String(text);
  }
  if ((node.widgets?.length ?? 0) > before && node.computeSize && node.setSize) {
    const min = node.computeSize();  // room for the text the first time it appears
    node.setSize([Math.max(node.size[0], min[0], 360), Math.max(node.size[1], min[1] + 120)]);
  }
  node.setDirtyCanvas?.(true, true);
}

function clearAll() {
  // A new run: the text of the last one is taken off, so a node that fails this time shows no stale summary
  // (a node ComfyUI serves from its cache gets its text back with the cached result).
  for (const node of app.graph?._nodes ?? []) {
    if (node?.constructor?.nodeData?.category !== CATEGORY) continue;
    for (const widget of node.widgets ?? []) {
      if (widget.name === "preview_text" || widget.name === FALLBACK) widget.value = "";
    }
  }
}

app.registerExtension({
  name: "lowbit_pipe.nodeText",
  async setup() {
    api.addEventListener("execution_start", clearAll);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.category !== CATEGORY) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      show(this, output);
    };
  },
  onNodeOutputsUpdated(outputs) {
    for (const [id, output] of Object.entries(outputs || {})) {
      const node = app.graph?.getNodeById?.(id);
      if (node?.constructor?.nodeData?.category === CATEGORY) show(node, output);
    }
  },
});
