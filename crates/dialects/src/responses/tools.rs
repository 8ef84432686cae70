//! Responses tools as chat functions: `function` as is, `custom` as a function of one
//! string `input`, `namespace` children flattened, the client-executed built-ins
//! (`local_shell`, `shell` with a local environment, `apply_patch`, `tool_search` with
//! `execution: "client"`) as functions with their payload as parameters; hosted tools
//! are set aside as unsupported. [`ToolSet`] keeps the way back from a chat function
//! name to the tool the client defined ([`ToolTarget`]); `tool_choice` is mapped here.

use serde_json::{json, Map, Value};

use crate::chat::{function_def, NameTable};
use crate::error::DialectError;
use crate::json::{at, idx, str_of};

/// The namespace Codex treats as "no namespace" (its top-level tools).
const DEFAULT_NAMESPACE: &str = "functions";

/// What kind of tool a chat function stands for, and so which output item its calls
/// come back as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ToolKind {
    /// A `function` tool: `function_call` items.
    Function,
    /// A `custom` tool (free-form or grammar input): `custom_tool_call` items.
    Custom,
    /// The `local_shell` tool: `local_shell_call` items.
    LocalShell,
    /// The `shell` tool with a local environment: `shell_call` items.
    Shell,
    /// The `apply_patch` tool: `apply_patch_call` items.
    ApplyPatch,
    /// `tool_search` executed by the client: `tool_search_call` items.
    ToolSearch,
}

impl ToolKind {
    /// The output item type of a call to such a tool.
    pub fn call_item_type(self) -> &'static str {
        match self {
            ToolKind::Function => "function_call",
            ToolKind::Custom => "custom_tool_call",
            ToolKind::LocalShell => "local_shell_call",
            ToolKind::Shell => "shell_call",
            ToolKind::ApplyPatch => "apply_patch_call",
            ToolKind::ToolSearch => "tool_search_call",
        }
    }

    /// Whether a call's chat arguments are sent to the client as they stream
    /// (`function_call_arguments.delta`); the others are converted whole at the end.
    pub fn streams_arguments(self) -> bool {
        self == ToolKind::Function
    }
}

/// The tool a chat function name stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolTarget {
    /// Its kind.
    pub kind: ToolKind,
    /// The name the client gave it (for built-ins, the tool type).
    pub name: String,
    /// The namespace it was defined in, when one.
    pub namespace: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Key {
    /// A named tool: (namespace, with `functions` and none the same, name). Function
    /// and custom tools share this key space, as they do in Codex's routing.
    Named(Option<String>, String),
    /// A built-in client tool, one per kind.
    Builtin(ToolKind),
}

#[derive(Debug, Clone)]
struct Entry {
    key: Key,
    chat_name: String,
    target: ToolTarget,
    /// The chat tool definition (`{"type":"function","function":{…}}`).
    def: Value,
}

/// The client's tools, translated.
#[derive(Debug, Clone, Default)]
pub(crate) struct ToolSet {
    entries: Vec<Entry>,
    names: NameTable,
    unsupported: Vec<String>,
}

fn norm_ns(ns: Option<&str>) -> Option<String> {
    match ns {
        None | Some("") | Some(DEFAULT_NAMESPACE) => None,
        Some(n) => Some(n.to_string()),
    }
}

/// The flattened name a namespaced tool is given (before sanitizing): `ns__name`.
pub(crate) fn flat_name(namespace: Option<&str>, name: &str) -> String {
    match norm_ns(namespace) {
        None => name.to_string(),
        Some(ns) => format!("{ns}__{name}"),
    }
}

impl ToolSet {
    /// The chat tool definitions, in order.
    pub(crate) fn chat_tools(&self) -> Vec<Value> {
        self.entries.iter().map(|e| e.def.clone()).collect()
    }

    /// The chat tool definitions whose chat names are in `names`.
    pub(crate) fn chat_tools_named(&self, names: &[String]) -> Vec<Value> {
        self.entries
            .iter()
            .filter(|e| names.contains(&e.chat_name))
            .map(|e| e.def.clone())
            .collect()
    }

    /// Whether any tool is sent upstream.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The hosted tools set aside (type, or `mcp:<server_label>`).
    pub(crate) fn unsupported(&self) -> &[String] {
        &self.unsupported
    }

    /// The tool a chat function name stands for.
    pub(crate) fn target(&self, chat_name: &str) -> Option<&ToolTarget> {
        self.entries
            .iter()
            .find(|e| e.chat_name == chat_name)
            .map(|e| &e.target)
    }

    /// The chat name of a named tool, when defined.
    pub(crate) fn chat_name(&self, namespace: Option<&str>, name: &str) -> Option<&str> {
        let key = Key::Named(norm_ns(namespace), name.to_string());
        self.entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.chat_name.as_str())
    }

    /// The chat name of a named tool defined anywhere (any namespace), when exactly
    /// one tool has this name.
    fn unique_by_name(&self, name: &str) -> Option<&str> {
        let mut found = self
            .entries
            .iter()
            .filter(|e| matches!(&e.key, Key::Named(_, n) if n == name));
        match (found.next(), found.next()) {
            (Some(e), None) => Some(e.chat_name.as_str()),
            _ => None,
        }
    }

    /// The chat name of a built-in client tool, when defined.
    pub(crate) fn builtin_name(&self, kind: ToolKind) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.key == Key::Builtin(kind))
            .map(|e| e.chat_name.as_str())
    }

    /// The chat name a call item in the conversation uses: the defined tool's, else
    /// the flattened name sanitized (a call to a tool no longer defined).
    pub(crate) fn call_name(&self, kind: ToolKind, namespace: Option<&str>, name: &str) -> String {
        let found = match kind {
            ToolKind::Function | ToolKind::Custom => self.chat_name(namespace, name),
            other => self.builtin_name(other),
        };
        match found {
            Some(n) => n.to_string(),
            None => crate::chat::sanitize(&flat_name(namespace, name)),
        }
    }

    /// Adds the tools of a `tools` array (or an `additional_tools` item). With
    /// `replace`, a tool defined again replaces the earlier definition (the later one
    /// is current); without, an already defined tool is kept.
    pub(crate) fn add(
        &mut self,
        tools: &[Value],
        path: &str,
        replace: bool,
    ) -> Result<(), DialectError> {
        for (i, t) in tools.iter().enumerate() {
            let p = idx(path, i);
            let o = t
                .as_object()
                .ok_or_else(|| DialectError::invalid(&p, format!("{p} must be an object")))?;
            let ty = str_of(o, "type").ok_or_else(|| {
                DialectError::invalid(at(&p, "type"), format!("{p}.type is required"))
            })?;
            match ty {
                "function" => self.add_function(o, None, &p, replace)?,
                "custom" => self.add_custom(o, None, &p, replace)?,
                "namespace" => {
                    let ns = required_name(o, &p)?;
                    let children = o.get("tools").and_then(Value::as_array).ok_or_else(|| {
                        DialectError::invalid(
                            at(&p, "tools"),
                            format!("{p}.tools must be an array of function and custom tools"),
                        )
                    })?;
                    for (j, c) in children.iter().enumerate() {
                        let cp = idx(&at(&p, "tools"), j);
                        let co = c.as_object().ok_or_else(|| {
                            DialectError::invalid(&cp, format!("{cp} must be an object"))
                        })?;
                        match str_of(co, "type") {
                            Some("function") => self.add_function(co, Some(ns), &cp, replace)?,
                            Some("custom") => self.add_custom(co, Some(ns), &cp, replace)?,
                            _ => {
                                return Err(DialectError::invalid(
                                    at(&cp, "type"),
                                    format!("{cp}.type must be function or custom"),
                                ))
                            }
                        }
                    }
                }
                "local_shell" => self.add_builtin(ToolKind::LocalShell, replace, local_shell_def),
                "apply_patch" => self.add_builtin(ToolKind::ApplyPatch, replace, apply_patch_def),
                "shell" if is_local_shell_env(o) => {
                    self.add_builtin(ToolKind::Shell, replace, shell_def)
                }
                "tool_search" if str_of(o, "execution") == Some("client") => {
                    let description = str_of(o, "description").map(str::to_string);
                    let parameters = o.get("parameters").filter(|v| !v.is_null()).cloned();
                    self.add_builtin(ToolKind::ToolSearch, replace, move |name| {
                        function_def(name, description.as_deref(), parameters.as_ref(), None)
                    })
                }
                other => {
                    let label = match (other, str_of(o, "server_label")) {
                        ("mcp", Some(l)) => format!("mcp:{l}"),
                        _ => other.to_string(),
                    };
                    if !self.unsupported.contains(&label) {
                        self.unsupported.push(label);
                    }
                }
            }
        }
        Ok(())
    }

    fn insert(
        &mut self,
        key: Key,
        wanted: &str,
        target: ToolTarget,
        replace: bool,
        def: impl FnOnce(&str) -> Value,
    ) {
        if let Some(pos) = self.entries.iter().position(|e| e.key == key) {
            if replace {
                let chat_name = self.entries[pos].chat_name.clone();
                self.entries[pos].def = def(&chat_name);
                self.entries[pos].target = target;
            }
            return;
        }
        let chat_name = self.names.assign(wanted);
        let def = def(&chat_name);
        self.entries.push(Entry {
            key,
            chat_name,
            target,
            def,
        });
    }

    fn add_function(
        &mut self,
        o: &Map<String, Value>,
        ns: Option<&str>,
        p: &str,
        replace: bool,
    ) -> Result<(), DialectError> {
        let name = required_name(o, p)?;
        let description = opt_str_field(o, "description", p)?;
        let parameters = match o.get("parameters") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(_) => {
                return Err(DialectError::invalid(
                    at(p, "parameters"),
                    format!("{p}.parameters must be a JSON schema object"),
                ))
            }
        };
        let strict = match o.get("strict") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => {
                return Err(DialectError::invalid(
                    at(p, "strict"),
                    format!("{p}.strict must be a boolean"),
                ))
            }
        };
        let target = ToolTarget {
            kind: ToolKind::Function,
            name: name.to_string(),
            namespace: ns.map(str::to_string),
        };
        self.insert(
            Key::Named(norm_ns(ns), name.to_string()),
            &flat_name(ns, name),
            target,
            replace,
            |chat| function_def(chat, description, parameters.as_ref(), strict),
        );
        Ok(())
    }

    fn add_custom(
        &mut self,
        o: &Map<String, Value>,
        ns: Option<&str>,
        p: &str,
        replace: bool,
    ) -> Result<(), DialectError> {
        let name = required_name(o, p)?;
        let mut description = opt_str_field(o, "description", p)?
            .unwrap_or("")
            .to_string();
        match o.get("format") {
            None | Some(Value::Null) => {}
            Some(Value::Object(f)) => match str_of(f, "type") {
                Some("text") => {}
                Some("grammar") => {
                    let syntax = str_of(f, "syntax").unwrap_or("lark");
                    let definition = str_of(f, "definition").ok_or_else(|| {
                        DialectError::invalid(
                            at(&at(p, "format"), "definition"),
                            format!("{p}.format.definition is required for a grammar"),
                        )
                    })?;
                    if !description.is_empty() {
                        description.push_str("\n\n");
                    }
                    description.push_str(&format!(
                        "The `input` string must follow this {syntax} grammar:\n{definition}"
                    ));
                }
                _ => {
                    return Err(DialectError::invalid(
                        at(&at(p, "format"), "type"),
                        format!("{p}.format.type must be text or grammar"),
                    ))
                }
            },
            Some(_) => {
                return Err(DialectError::invalid(
                    at(p, "format"),
                    format!("{p}.format must be an object"),
                ))
            }
        }
        let target = ToolTarget {
            kind: ToolKind::Custom,
            name: name.to_string(),
            namespace: ns.map(str::to_string),
        };
        let parameters = json!({
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's input, as free-form text."}},
            "required": ["input"],
            "additionalProperties": false,
        });
        let description = (!description.is_empty()).then_some(description);
        self.insert(
            Key::Named(norm_ns(ns), name.to_string()),
            &flat_name(ns, name),
            target,
            replace,
            |chat| function_def(chat, description.as_deref(), Some(&parameters), None),
        );
        Ok(())
    }

    fn add_builtin(&mut self, kind: ToolKind, replace: bool, def: impl FnOnce(&str) -> Value) {
        let wanted = builtin_type(kind);
        let target = ToolTarget {
            kind,
            name: wanted.to_string(),
            namespace: None,
        };
        self.insert(Key::Builtin(kind), wanted, target, replace, def);
    }
}

/// The tool type of a built-in kind (its chat function name when free).
pub(crate) fn builtin_type(kind: ToolKind) -> &'static str {
    match kind {
        ToolKind::LocalShell => "local_shell",
        ToolKind::Shell => "shell",
        ToolKind::ApplyPatch => "apply_patch",
        ToolKind::ToolSearch => "tool_search",
        ToolKind::Function => "function",
        ToolKind::Custom => "custom",
    }
}

fn is_local_shell_env(o: &Map<String, Value>) -> bool {
    o.get("environment")
        .and_then(Value::as_object)
        .and_then(|e| str_of(e, "type"))
        == Some("local")
}

fn required_name<'a>(o: &'a Map<String, Value>, p: &str) -> Result<&'a str, DialectError> {
    match o.get("name") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        _ => Err(DialectError::invalid(
            at(p, "name"),
            format!("{p}.name must be a non-empty string"),
        )),
    }
}

fn opt_str_field<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    p: &str,
) -> Result<Option<&'a str>, DialectError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(DialectError::invalid(
            at(p, key),
            format!("{p}.{key} must be a string"),
        )),
    }
}

fn local_shell_def(name: &str) -> Value {
    function_def(
        name,
        Some("Runs a command on the user's machine and returns its output."),
        Some(&json!({
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}, "description": "The program and its arguments."},
                "working_directory": {"type": "string"},
                "timeout_ms": {"type": "integer"},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
                "user": {"type": "string"}
            },
            "required": ["command"]
        })),
        None,
    )
}

fn shell_def(name: &str) -> Value {
    function_def(
        name,
        Some("Runs shell commands, in order, on the user's machine and returns their output."),
        Some(&json!({
            "type": "object",
            "properties": {
                "commands": {"type": "array", "items": {"type": "string"}},
                "timeout_ms": {"type": "integer"},
                "max_output_length": {"type": "integer"}
            },
            "required": ["commands"]
        })),
        None,
    )
}

fn apply_patch_def(name: &str) -> Value {
    function_def(
        name,
        Some("Creates, updates or deletes one file with a unified diff."),
        Some(&json!({
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": ["create_file", "update_file", "delete_file"]},
                "path": {"type": "string", "description": "Relative to the workspace root."},
                "diff": {"type": "string", "description": "The unified diff (create_file, update_file)."}
            },
            "required": ["type", "path"]
        })),
        None,
    )
}

/// A `tool_choice` as chat sends it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Choice {
    /// Send this `tool_choice` value.
    Value(Value),
    /// `allowed_tools`: send only these chat functions, with this `tool_choice`.
    Allowed(Vec<String>, Value),
}

/// Checks a `tool_choice`'s shape (at parse time, before every tool is known).
pub(crate) fn check_choice(v: &Value) -> Result<(), DialectError> {
    match v {
        Value::String(s) => crate::json::one_of(s, &["auto", "none", "required"], "tool_choice"),
        Value::Object(o) => match str_of(o, "type") {
            Some(_) => Ok(()),
            None => Err(DialectError::invalid(
                "tool_choice.type",
                "tool_choice.type is required",
            )),
        },
        other => Err(DialectError::invalid(
            "tool_choice",
            format!(
                "tool_choice must be a string or an object (got {})",
                crate::json::type_name(other)
            ),
        )),
    }
}

/// The chat `tool_choice` of a Responses `tool_choice`.
pub(crate) fn chat_choice(v: &Value, tools: &ToolSet) -> Result<Choice, DialectError> {
    let function = |name: &str| json!({"type": "function", "function": {"name": name}});
    match v {
        Value::String(s) => {
            if s == "required" && tools.is_empty() {
                return Err(hosted_required("tool_choice", tools));
            }
            Ok(Choice::Value(Value::String(s.clone())))
        }
        Value::Object(o) => {
            let ty = str_of(o, "type").unwrap_or_default();
            match ty {
                "function" | "custom" => {
                    let name = str_of(o, "name").ok_or_else(|| {
                        DialectError::invalid("tool_choice.name", "tool_choice.name is required")
                    })?;
                    let ns = str_of(o, "namespace");
                    let chat = tools
                        .chat_name(ns, name)
                        .or_else(|| if ns.is_none() { tools.unique_by_name(name) } else { None })
                        .ok_or_else(|| {
                            DialectError::invalid(
                                "tool_choice.name",
                                format!("tool_choice names {ty} tool {name:?}, which is not in tools"),
                            )
                        })?;
                    Ok(Choice::Value(function(chat)))
                }
                "local_shell" | "shell" | "apply_patch" | "tool_search" => {
                    let kind = match ty {
                        "local_shell" => ToolKind::LocalShell,
                        "shell" => ToolKind::Shell,
                        "apply_patch" => ToolKind::ApplyPatch,
                        _ => ToolKind::ToolSearch,
                    };
                    match tools.builtin_name(kind) {
                        Some(chat) => Ok(Choice::Value(function(chat))),
                        None => Err(DialectError::invalid(
                            "tool_choice.type",
                            format!("tool_choice requires the {ty} tool, which polygw's sources cannot run (or it is not in tools)"),
                        )),
                    }
                }
                "allowed_tools" => {
                    let mode = match str_of(o, "mode") {
                        Some(m @ ("auto" | "required")) => m,
                        _ => {
                            return Err(DialectError::invalid(
                                "tool_choice.mode",
                                "tool_choice.mode must be auto or required",
                            ))
                        }
                    };
                    let list = o.get("tools").and_then(Value::as_array).ok_or_else(|| {
                        DialectError::invalid("tool_choice.tools", "tool_choice.tools must be an array")
                    })?;
                    let mut names = Vec::new();
                    for (i, t) in list.iter().enumerate() {
                        let p = idx("tool_choice.tools", i);
                        let to = t.as_object().ok_or_else(|| {
                            DialectError::invalid(&p, format!("{p} must be an object"))
                        })?;
                        match Choice::from_one(to, tools) {
                            Some(chat) => names.push(chat),
                            // A hosted tool: not sent, so not allowed either.
                            None if is_hosted_choice(to) => {}
                            None => {
                                return Err(DialectError::invalid(
                                    &p,
                                    format!("{p} names a tool that is not in tools"),
                                ))
                            }
                        }
                    }
                    if names.is_empty() && mode == "required" {
                        return Err(hosted_required("tool_choice.tools", tools));
                    }
                    let choice = if names.is_empty() { "none" } else { mode };
                    Ok(Choice::Allowed(names, Value::String(choice.to_string())))
                }
                other => Err(DialectError::invalid(
                    "tool_choice.type",
                    format!("tool_choice requires the hosted tool {other:?}, which polygw's sources cannot run"),
                )),
            }
        }
        _ => Err(DialectError::invalid(
            "tool_choice",
            "tool_choice must be a string or an object",
        )),
    }
}

impl Choice {
    /// The chat name of one `allowed_tools` entry, when it names a sent tool.
    fn from_one(o: &Map<String, Value>, tools: &ToolSet) -> Option<String> {
        match str_of(o, "type")? {
            "function" | "custom" => {
                let name = str_of(o, "name")?;
                let ns = str_of(o, "namespace");
                tools
                    .chat_name(ns, name)
                    .or_else(|| {
                        if ns.is_none() {
                            tools.unique_by_name(name)
                        } else {
                            None
                        }
                    })
                    .map(str::to_string)
            }
            "local_shell" => tools.builtin_name(ToolKind::LocalShell).map(str::to_string),
            "shell" => tools.builtin_name(ToolKind::Shell).map(str::to_string),
            "apply_patch" => tools.builtin_name(ToolKind::ApplyPatch).map(str::to_string),
            "tool_search" => tools.builtin_name(ToolKind::ToolSearch).map(str::to_string),
            _ => None,
        }
    }
}

fn is_hosted_choice(o: &Map<String, Value>) -> bool {
    !matches!(
        str_of(o, "type"),
        Some("function" | "custom" | "local_shell" | "shell" | "apply_patch" | "tool_search")
    )
}

fn hosted_required(param: &str, tools: &ToolSet) -> DialectError {
    let hosted = if tools.unsupported().is_empty() {
        "no tools are defined".to_string()
    } else {
        format!(
            "only hosted tools are defined ({}), which polygw's sources cannot run",
            tools.unsupported().join(", ")
        )
    };
    DialectError::invalid(
        param,
        format!("tool_choice requires a tool call, but {hosted}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(tools: Value) -> ToolSet {
        let mut s = ToolSet::default();
        s.add(tools.as_array().unwrap(), "tools", true).unwrap();
        s
    }

    #[test]
    fn tool_kinds_table() {
        let s = set(json!([
            {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": false},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
            {"type": "namespace", "name": "mcp__github", "description": "GitHub", "tools": [
                {"type": "function", "name": "create_issue"},
                {"type": "custom", "name": "free"}
            ]},
            {"type": "namespace", "name": "functions", "description": "", "tools": [{"type": "function", "name": "wait"}]},
            {"type": "local_shell"},
            {"type": "shell", "environment": {"type": "local"}},
            {"type": "shell"},
            {"type": "tool_search", "execution": "client", "description": "find tools", "parameters": {"type": "object"}},
            {"type": "tool_search"},
            {"type": "web_search"},
            {"type": "mcp", "server_label": "deepwiki"},
            {"type": "image_generation"}
        ]));
        let table = [
            ("shell", ToolKind::Function, "shell", None),
            ("apply_patch", ToolKind::Custom, "apply_patch", None),
            (
                "mcp__github__create_issue",
                ToolKind::Function,
                "create_issue",
                Some("mcp__github"),
            ),
            (
                "mcp__github__free",
                ToolKind::Custom,
                "free",
                Some("mcp__github"),
            ),
            ("wait", ToolKind::Function, "wait", Some("functions")),
            ("local_shell", ToolKind::LocalShell, "local_shell", None),
            ("shell_2", ToolKind::Shell, "shell", None),
            ("tool_search", ToolKind::ToolSearch, "tool_search", None),
        ];
        for (chat, kind, name, ns) in table {
            let t = s.target(chat).unwrap_or_else(|| panic!("{chat} missing"));
            assert_eq!(
                (t.kind, t.name.as_str(), t.namespace.as_deref()),
                (kind, name, ns),
                "{chat}"
            );
        }
        assert_eq!(s.chat_tools().len(), 8);
        assert_eq!(
            s.unsupported(),
            [
                "shell",
                "tool_search",
                "web_search",
                "mcp:deepwiki",
                "image_generation"
            ]
        );
        let custom = &s.chat_tools()[1]["function"];
        assert!(custom["description"]
            .as_str()
            .unwrap()
            .contains("lark grammar:\nstart: x"));
        assert_eq!(custom["parameters"]["required"], json!(["input"]));
        // `functions` is Codex's "no namespace": both spellings find the tool.
        assert_eq!(s.chat_name(Some("functions"), "shell"), Some("shell"));
        assert_eq!(s.chat_name(None, "wait"), Some("wait"));
        assert_eq!(
            s.call_name(ToolKind::Function, Some("mcp__x"), "gone"),
            "mcp__x__gone"
        );
    }

    #[test]
    fn tool_choice_table() {
        let s = set(json!([
            {"type": "function", "name": "f"},
            {"type": "namespace", "name": "crm", "description": "", "tools": [{"type": "function", "name": "orders"}]},
            {"type": "apply_patch"},
            {"type": "web_search"}
        ]));
        let f = |n: &str| json!({"type": "function", "function": {"name": n}});
        let ok = [
            (json!("auto"), Choice::Value(json!("auto"))),
            (json!("none"), Choice::Value(json!("none"))),
            (json!("required"), Choice::Value(json!("required"))),
            (
                json!({"type": "function", "name": "f"}),
                Choice::Value(f("f")),
            ),
            (
                json!({"type": "function", "name": "orders", "namespace": "crm"}),
                Choice::Value(f("crm__orders")),
            ),
            (
                json!({"type": "function", "name": "orders"}),
                Choice::Value(f("crm__orders")),
            ),
            (
                json!({"type": "apply_patch"}),
                Choice::Value(f("apply_patch")),
            ),
            (
                json!({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]}),
                Choice::Allowed(vec!["f".into()], json!("required")),
            ),
        ];
        for (v, want) in ok {
            assert_eq!(chat_choice(&v, &s).unwrap(), want, "{v}");
        }
        let refused = [
            (json!({"type": "web_search_preview"}), "tool_choice.type"),
            (
                json!({"type": "function", "name": "nope"}),
                "tool_choice.name",
            ),
            (
                json!({"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}),
                "tool_choice.tools",
            ),
            (json!({"type": "shell"}), "tool_choice.type"),
        ];
        for (v, param) in refused {
            assert_eq!(
                chat_choice(&v, &s).unwrap_err().param.as_deref(),
                Some(param),
                "{v}"
            );
        }
        let hosted_only = set(json!([{"type": "web_search"}]));
        let e = chat_choice(&json!("required"), &hosted_only).unwrap_err();
        assert!(e.message.contains("web_search"), "{}", e.message);
        assert!(check_choice(&json!("sometimes")).is_err());
    }
}
