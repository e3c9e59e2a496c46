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

{{/*
The operator's cache policy, as JSON (weightcache_operator.policy.Policy): the
same values the cache-policy ValidatingAdmissionPolicy enforces at admission.
The set-up image is the operator's own: it alone runs the privileged step.
*/}}
{{- define "wc.policy" -}}
{{- $policy := dict
  "setupImage" (include "wc.imageRef" (list .Values.image .Chart.AppVersion))
  "sidecarImage" (include "wc.imageRef" (list .Values.sidecarImage .Chart.AppVersion))
  "daemonServiceAccount" .Values.daemon.serviceAccount.name
  "daemonNamespace" (include "wc.daemonNamespace" .)
  "allowedModelClaims" .Values.cachePolicy.allowedModelClaims
  "namespaceModelSources" .Values.cachePolicy.namespaceModelSources
  "allowedResourceClaims" .Values.cachePolicy.allowedResourceClaims
  "allowedHostPaths" .Values.cachePolicy.allowedHostPaths
  "allowedSidecarImagePrefixes" .Values.cachePolicy.allowedSidecarImagePrefixes
  "allowedTransports" .Values.cachePolicy.allowedTransports
  "allowedGpuAccessModes" .Values.cachePolicy.allowedGpuAccessModes
  "allowedPriorityClasses" .Values.cachePolicy.allowedPriorityClasses
  "allowedTolerations" .Values.cachePolicy.allowedTolerations
  "maxSidecarResources" .Values.cachePolicy.maxSidecarResources }}
{{- toJson $policy }}
{{- end }}

{{/* The namespace every cache's DaemonSet runs in. */}}
{{- define "wc.daemonNamespace" -}}
{{- .Values.daemon.namespace | default .Release.Namespace }}
{{- end }}

{{/* The daemon ServiceAccount's username. */}}
{{- define "wc.daemonUsername" -}}
{{- printf "system:serviceaccount:%s:%s" (include "wc.daemonNamespace" .) .Values.daemon.serviceAccount.name }}
{{- end }}
