{{/* Chart name, truncated to a DNS label. */}}
{{- define "wc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "wc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "wc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "wc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "wc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightcache
{{- end }}

{{- define "wc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "wc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository[:tag][@digest]; a digest pins the image, the tag then only documents it. */}}
{{- define "wc.imageRef" -}}
{{- $image := index . 0 }}
{{- $appVersion := index . 1 }}
{{- $ref := $image.repository }}
{{- $tag := default $appVersion $image.tag }}
{{- if $tag }}{{ $ref = printf "%s:%s" $ref $tag }}{{ end }}
{{- if $image.digest }}{{ $ref = printf "%s@%s" $ref $image.digest }}{{ end }}
{{- $ref }}
{{- end }}

{{/* Namespaces that get the daemon ServiceAccount and Role, one per line. */}}
{{- define "wc.daemonNamespaces" -}}
{{- $namespaces := .Values.daemon.namespaces | default (list .Release.Namespace) }}
{{- range $namespaces }}
{{ . }}
{{- end }}
{{- end }}

{{/* The daemon ServiceAccounts' usernames, as a CEL list literal. */}}
{{- define "wc.daemonUsernames" -}}
{{- $sa := .Values.daemon.serviceAccount.name }}
{{- $names := list }}
{{- range (include "wc.daemonNamespaces" . | trim | splitList "\n") }}
{{- $names = append $names (printf "'system:serviceaccount:%s:%s'" . $sa) }}
{{- end }}
{{- printf "[%s]" (join ", " $names) }}
{{- end }}

{{/*
The operator's rules: the same list as weightcache_operator.rbac.OPERATOR_RULES
(tests/unit/chart/test_chart_rbac.py keeps them equal). Cluster-wide: the
operator watches every namespace (kopf standalone, clusterwide).
*/}}
{{- define "wc.operatorRules" }}
# Watch caches; kopf patches its finalizer and progress annotations on them.
- apiGroups: ["weightcache.dev"]
  resources: ["weightcaches"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["weightcache.dev"]
  resources: ["weightcaches/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers
# (where the OwnerReferencesPermissionEnforcement admission plugin is on).
- apiGroups: ["weightcache.dev"]
  resources: ["weightcaches/finalizers"]
  verbs: ["update"]
# Server-side apply of the daemon DaemonSet (create on first apply).
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["list", "watch", "create", "patch"]
# Daemon pods (reports) and engine pods (readiness gates).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# weightcache.dev/<name>=Ready node labels.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
